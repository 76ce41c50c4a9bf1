"""Case generators for the operators of :mod:`unity_pcg.ops.spatial` (merged into op_cases.GENERATORS).

Shapes stay small (the piecewise evaluator runs the kernel once per task) but every generator mixes
configurations whose spatial dims may stay partitioned (pointwise / non-overlapping windows, unpadded
or unresized dims) with ones that must refuse it, so both the acceptance and the refusal tests bite.
"""
from __future__ import annotations

from .op_cases import Case, Drawer, _shape


def _window(d: Drawer, n: int, dilated: bool = True):
    """kernel, stride, dilation, padding (2n) and a spatial size per dim."""
    style = d.int(0, 3)
    if style == 0:        # pointwise
        k, s, dl, pad = (1,) * n, tuple(d.choice([1, 1, 2]) for _ in range(n)), (1,) * n, (0,) * (2 * n)
    elif style == 1:      # non-overlapping windows (patchify)
        k = tuple(d.choice([1, 2]) for _ in range(n))
        s = tuple(d.choice([kk, 2]) for kk in k)
        dl, pad = (1,) * n, (0,) * (2 * n)
    else:
        k = tuple(d.choice([1, 2, 3]) for _ in range(n))
        s = tuple(d.choice([1, 2]) for _ in range(n))
        dl = tuple(d.choice([1, 2]) if dilated else 1 for _ in range(n))
        pad = tuple(d.int(0, 1) for _ in range(2 * n))
    sizes = [max(d.choice([2, 4] if n == 3 else [2, 4, 6, 8]), (kk - 1) * dd + 1) for kk, dd in zip(k, dl)]
    return k, s, dl, pad, sizes


def gen_conv3d(d: Drawer) -> Case:
    n = d.choice([1, 2])
    g = d.choice([1, 1, 2])
    cig, cog = d.choice([1, 2]), d.choice([1, 2])
    k, s, dl, pad, sp = _window(d, 3)
    bias = d.bool(0.4)
    sizes = [[n, g * cig] + sp, [g * cog, cig] + list(k)] + ([[g * cog]] if bias else [])
    return Case("Conv3d", {"groups": g, "stride": s, "padding": pad, "dilation": dl}, sizes,
                ["float64"] * len(sizes), ["normal"] * len(sizes))


def gen_pool(op: str, n: int):
    def g(d: Drawer) -> Case:
        b, c = d.choice([1, 2, 4]), d.choice([1, 2, 3])
        kind = d.choice(["max", "avg"])
        if d.bool(0.2):
            sp = [d.choice([1, 2, 3]) for _ in range(n)]
            return Case(op, {"kind": kind, "global_pool": True}, [[b, c] + sp], ["float64"], ["normal"])
        k, s, dl, pad, sp = _window(d, n)
        spans = [(k[j % n] - 1) * dl[j % n] + 1 for j in range(2 * n)]
        if d.bool(0.5):   # paddings up to half the window, as exporters emit
            pad = tuple(d.int(0, sp_ // 2) for sp_ in spans)
        pad = tuple(min(p, sp_ - 1) for p, sp_ in zip(pad, spans))   # a window never holds only padding
        # a padded dim longer than one window: when a single window covers the whole padded dim, an average
        # (count_include_pad) of padded pieces adds up to the average of the whole, a coincidence that would
        # make the (sound) refusal of padded spatial splits look over-conservative
        sp = [max(s_, spans[j] + 1) if pad[j] or pad[j + n] else s_ for j, s_ in enumerate(sp)]
        attrs = {"kind": kind, "kernel": k, "stride": s, "dilation": dl, "padding": pad,
                 "ceil_mode": d.bool(), "count_include_pad": d.bool()}
        return Case(op, attrs, [[b, c] + sp], ["float64"], ["normal"])
    return g


def gen_convtranspose(d: Drawer) -> Case:
    n = d.choice([1, 2, 2, 3])
    b = d.choice([1, 2])
    g = d.choice([1, 1, 2])
    cig, cog = d.choice([1, 2]), d.choice([1, 2])
    if d.bool(0.4):       # span == stride, no padding: spatial pieces map to pieces
        k = tuple(d.choice([1, 2]) for _ in range(n))
        s, dl, pad, opad = k, (1,) * n, (0,) * (2 * n), (0,) * n
    else:
        k = tuple(d.choice([1, 2, 3]) for _ in range(n))
        s = tuple(d.choice([1, 2]) for _ in range(n))
        dl = tuple(d.choice([1, 1, 2]) for _ in range(n))
        opad = tuple(d.int(0, ss - 1) for ss in s)
        pad = tuple(d.int(0, 1) for _ in range(2 * n))
    sp = [d.choice([1, 2, 3, 4] if n < 3 else [1, 2]) for _ in range(n)]
    for j in range(n):   # keep at least one output element per dim
        while (sp[j] - 1) * s[j] + (k[j] - 1) * dl[j] + 1 + opad[j] - pad[j] - pad[j + n] < 1:
            sp[j] += 1
    bias = d.bool(0.4)
    sizes = [[b, g * cig] + sp, [g * cig, cog] + list(k)] + ([[g * cog]] if bias else [])
    return Case("ConvTranspose", {"groups": g, "stride": s, "padding": pad, "dilation": dl, "output_padding": opad},
                sizes, ["float64"] * len(sizes), ["normal"] * len(sizes))


def _spatial(d: Drawer, lo: int, hi: int) -> list[int]:
    sp = [d.choice([1, 2, 3, 4]) for _ in range(d.int(lo, hi))]
    if sp and max(sp) == 1:   # one element per instance normalizes to 0 whatever the input: degenerate
        sp[-1] = 2
    return sp


def gen_instancenorm(d: Drawer) -> Case:
    c = d.choice([1, 2, 3, 4])
    x = [d.choice([1, 2, 4]), c] + _spatial(d, 1, 3)
    return Case("InstanceNorm", {"eps": d.choice([1e-5, 1e-3])}, [x, [c], [c]], ["float64"] * 3,
                ["normal"] * 3)


def gen_groupnorm(d: Drawer) -> Case:
    g = d.choice([1, 2, 3, 4])
    per = d.choice([1, 2])
    c = g * per
    sp = _spatial(d, 0 if per > 1 else 1, 2)
    x = [d.choice([1, 2, 4]), c] + sp
    return Case("GroupNorm", {"groups": g, "eps": d.choice([1e-5, 1e-3])}, [x, [c], [c]], ["float64"] * 3,
                ["normal"] * 3)


COORD = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_half_pixel_for_nn",
         "half_pixel_symmetric")


def gen_resize(d: Drawer) -> Case:
    r = d.int(3, 4)
    x = [d.choice([1, 2, 4]), d.choice([1, 2, 3])] + [d.choice([1, 2, 3, 4]) for _ in range(r - 2)]
    resized = [j for j in range(2, r) if d.bool(0.7)] or [r - 1]
    sizes, scales = list(x), [1.0] * r
    for j in resized:
        if d.bool():     # scales given: out = floor(in * scale)
            f = d.choice([0.5, 1.5, 2.0, 3.0])
            if int(x[j] * f) < 1:
                f = 2.0
            sizes[j], scales[j] = int(x[j] * f), f
        else:            # sizes given: the transform divides by out / in
            sizes[j] = d.choice([1, 2, 3, 5, 6])
            scales[j] = sizes[j] / x[j]
    attrs = {"sizes": tuple(sizes), "scales": tuple(scales), "mode": d.choice(["nearest", "linear"]),
             "coordinate_mode": d.choice(COORD),
             "nearest_mode": d.choice(["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])}
    return Case("Resize", attrs, [x], ["float64"], ["normal"])


def gen_pad(d: Drawer) -> Case:
    x = _shape(d, 1, 4, sizes=(1, 2, 3, 4, 6), max_numel=96)
    r = len(x)
    mode = d.choice(["constant", "constant", "reflect", "edge", "wrap"])
    pads = [0] * (2 * r)
    for j in d.subset(range(r)) or [r - 1]:
        hi = x[j] - 1 if mode == "reflect" else 2
        pads[j], pads[j + r] = d.int(0, hi), d.int(0, hi)
    if not any(pads):   # pad something (a dim of size 1 cannot be reflect-padded: use edge)
        mode = "edge" if mode == "reflect" else mode
        pads[r - 1 + r] = 1
    value = d.choice([0.0, 0.0, 1.5]) if mode == "constant" else 0.0
    return Case("Pad", {"pads": tuple(pads), "mode": mode, "value": value}, [x], ["float64"], ["normal"])


GENERATORS: dict = {
    "Conv3d": gen_conv3d, "Pool1d": gen_pool("Pool1d", 1), "Pool3d": gen_pool("Pool3d", 3),
    "ConvTranspose": gen_convtranspose, "InstanceNorm": gen_instancenorm, "GroupNorm": gen_groupnorm,
    "Resize": gen_resize, "Pad": gen_pad,
}
