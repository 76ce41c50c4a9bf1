"""Progress bars for long commands (tqdm), shown only where a terminal is attached.

``bar(total, desc)`` counts items (steps, rule candidates); ``time_bar(desc, seconds)`` fills as time
passes against a budget (a search).  Where the stream is not a terminal (a pipe, a log file, a test)
both return a bar that draws nothing, so redirected output stays one line per event.  The environment
variable ``UNITY_PCG_PROGRESS`` overrides the terminal test: ``0`` never draws, ``1`` always does.
"""
from __future__ import annotations

import os
import sys


def enabled(stream=None) -> bool:
    """Whether bars are drawn on ``stream`` (default stderr): a terminal, unless UNITY_PCG_PROGRESS says."""
    force = os.environ.get("UNITY_PCG_PROGRESS", "").strip()
    if force in ("0", "1"):
        return force == "1"
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


class _Silent:
    """The bar where none is drawn: the same methods, doing nothing."""
    drawn = False
    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def write(self, s: str) -> None:
        pass

    def advance_to(self, value: float, text: str | None = None) -> None:
        self.n = value

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bar(total: int | None, desc: str, unit: str = "it", stream=None, show: bool | None = None):
    """A tqdm bar of ``total`` items on ``stream`` (default stderr) when :func:`enabled`, else a silent one."""
    stream = sys.stderr if stream is None else stream
    if not (enabled(stream) if show is None else show):
        return _Silent()
    from tqdm import tqdm
    b = tqdm(total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True, leave=True)
    b.drawn = True
    b.advance_to = lambda value, text=None: _advance(b, value, text)
    return b


def time_bar(desc: str, total_s: float, stream=None, show: bool | None = None):
    """A bar over ``total_s`` seconds (a budget): ``advance_to(elapsed_s, text)`` moves it."""
    stream = sys.stderr if stream is None else stream
    if not (enabled(stream) if show is None else show):
        return _Silent()
    from tqdm import tqdm
    b = tqdm(total=round(float(total_s), 1), desc=desc, unit="s", file=stream, dynamic_ncols=True, leave=True,
             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.0f} s {postfix}")
    b.drawn = True
    b.advance_to = lambda value, text=None: _advance(b, value, text)
    return b


def _advance(b, value: float, text: str | None) -> None:
    value = round(min(float(value), b.total), 1) if b.total else round(float(value), 1)
    if value > b.n:
        b.update(value - b.n)
    if text is not None:
        b.set_postfix_str(text)
