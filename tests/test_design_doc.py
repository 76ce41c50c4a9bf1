"""DESIGN.md stays a map: short, and pointing at things that exist.

* at most 30,000 bytes (``wc -c``); measurements go to ``benchmarks/results/``;
* every backticked repository path in it (outside code blocks) exists: a file path with an extension
  (``search/optimize.py``), a folder path ending in ``/`` (``unity_pcg/commands/``), or a glob that must
  match something (``benchmarks/results/*.md``); placeholders (upper case, ``<...>``) are not paths;
* every section the code cites as DESIGN plus a quoted heading is a heading of DESIGN.md.
"""
from __future__ import annotations

import glob
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "DESIGN.md"
LIMIT = 30_000
EXTENSIONS = {"py", "md", "json", "sh", "toml", "txt", "cfg", "yaml", "yml", "ini", "png"}
PATH = re.compile(r"^[a-z0-9_.\-/*]+$")          # repository paths are lower case here; DIR/..., FILE.x are not
CITE = re.compile("DESIGN" + r' "([^"]+)"')      # split so this file does not cite itself


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _paths(text: str) -> list[str]:
    out = []
    for span in re.findall(r"`([^`\n]+)`", _prose(text)):
        if "/" not in span or not PATH.match(span) or span.startswith(("/", "..")):
            continue
        last = span.rstrip("/").rsplit("/", 1)[-1]
        if span.endswith("/") or "*" in span or ("." in last and last.rsplit(".", 1)[1] in EXTENSIONS):
            out.append(span)
    return out


def _headings(text: str) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", _prose(text), flags=re.M)}


def test_design_doc_is_short():
    n = len(_text().encode("utf-8"))
    assert n <= LIMIT, (f"DESIGN.md is {n} bytes (limit {LIMIT}): move measurements and histories to "
                        f"benchmarks/results/ and keep the contracts")


def test_design_doc_paths_exist():
    paths = _paths(_text())
    assert len(paths) >= 20, f"expected DESIGN.md to name the repository's files, found {paths}"
    missing = []
    for p in paths:
        if "*" in p:
            if not glob.glob(str(ROOT / p)):
                missing.append(p)
        elif p.endswith("/"):
            if not (ROOT / p).is_dir():
                missing.append(p)
        elif not (ROOT / p).is_file():
            missing.append(p)
    assert not missing, f"DESIGN.md names paths that do not exist (write them from the repository root): {missing}"


def test_code_citations_name_design_headings():
    heads = _headings(_text())
    bad = []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT)
        if any(part.startswith(".") or part in ("build", "dist") for part in rel.parts) or f == Path(__file__).resolve():
            continue
        for m in CITE.finditer(f.read_text(encoding="utf-8", errors="replace")):
            name = " ".join(m.group(1).split())
            if name not in heads:
                bad.append(f"{rel}: {name!r}")
    assert not bad, f"code cites DESIGN sections that are not headings of DESIGN.md: {bad}"
