"""`unity-pcg calibrate [--quick] -o local.json`: measure this computer and write a MachineSpec JSON."""
from __future__ import annotations

import sys

from ..errors import UnityError

HELP = "measure this computer and write a machine description (JSON)"


def add_arguments(p) -> None:
    p.add_argument("-o", "--output", default="local.json", metavar="FILE",
                   help="machine JSON to write (default local.json); use it as --machine FILE[:1xN]")
    p.add_argument("--quick", action="store_true", help="smaller measurements (at most about a minute)")
    p.add_argument("--worlds", default=None, metavar="LIST",
                   help="comma-separated numbers of concurrent processes to calibrate for: compute, DDP overheads and "
                        "gloo collectives are measured with that many processes running (default 2,3,4; quick 2,4)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--precision", default=None, metavar="{fp32,tf32,bf16}",
                   help="math mode whose kernels are measured and recorded (default: every mode the device has)")
    p.add_argument("--device", choices=("local", "cuda", "cpu"), default="local",
                   help="local: this computer's CPU processes (default); cuda: one GPU's kernels per operator class "
                        "and math mode, NCCL collectives with several GPUs (calibration/gpu.py); cpu: the same "
                        "kernel measurements on this CPU, one process")
    p.add_argument("--size", choices=("tiny", "quick", "full"), default=None,
                   help="--device cuda/cpu: kernel sizes measured (default full; quick with --quick)")
    p.add_argument("--base", default=None, metavar="PRESET",
                   help="--device cuda/cpu: preset whose topology and network link the machine keeps "
                        "(default: from the GPU's name, h100 / dgx-a100 / summit; local on a CPU)")


def run(args) -> int:
    from .simulate_cmd import check_precision_arg
    check_precision_arg(getattr(args, "precision", None))
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UnityError("calibrate needs torch (pip install 'unity-pcg[torch]')") from None
    from unity_pcg.calibration.local import calibrate

    worlds = None
    if args.worlds:
        try:
            worlds = tuple(int(x) for x in args.worlds.split(","))
        except ValueError:
            raise UnityError(f"--worlds must be comma-separated integers, got {args.worlds!r}") from None
        if any(w < 2 or w > 64 for w in worlds):
            raise UnityError(f"--worlds: process counts must be between 2 and 64, got {args.worlds!r}")
    device = getattr(args, "device", "local")
    if device != "local":
        if args.worlds:
            raise UnityError("--worlds applies to --device local only")
        m = calibrate(quick=args.quick, quiet=args.quiet, device=device,
                      precision=getattr(args, "precision", None), size=args.size, base=args.base)
    else:
        m = calibrate(quick=args.quick, worlds=worlds, quiet=args.quiet)
    try:
        m.save(args.output)
    except OSError as e:
        raise UnityError(f"cannot write {args.output!r}: {e.strerror}") from None
    print(f"wrote {args.output}: {m.describe()}; links {m.links['group'].bandwidth / 1e9:.2f} GB/s, "
          f"{m.links['group'].latency * 1e6:.0f} us", file=sys.stdout)
    return 0
