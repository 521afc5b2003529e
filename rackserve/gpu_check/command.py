"""`rackserve check-gpu`: validate a GPU machine in one command, meant to end within 8 minutes on one H200.

    rackserve check-gpu [--out check-gpu.json] [--budget-s 420] [--experts 32]
    rackserve check-gpu --small          # the same code paths on CPU, tiny shapes, Triton's interpreter

Four parts, each printing its table:
  1. kernels   every Triton kernel against its torch reference at V4-Flash's per-layer sizes
  2. weights   the FP8 linears and FP4-expert MoE FFN (block-scaled weight kernels), the same way
  3. nixl      a NIXL write between two agents' pools on the GPU (VRAM to VRAM)
  4. model     a 4-layer V4-Flash-shaped FP8+FP4 model through the engine: torch path vs Triton kernels
A part that raises or exceeds a tolerance is reported failed and the others still run; no part starts
after `--budget-s` seconds (it is reported skipped). The last line printed is one JSON object of
headline figures, also written to `--out`; the exit status is 0 only if every part ran and passed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

# light on purpose: `rackserve --help` imports this module (torch and the parts load when the check runs)
PARTS = (
    ("kernels", "Triton kernels vs torch references"),
    ("weights", "FP8 / FP4 weight kernels vs torch references"),
    ("nixl", "NIXL write between two agents on this device"),
    ("model", "4-layer V4-Flash-shaped FP8+FP4 model: torch path vs Triton kernels"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="check-gpu.json", help="where the JSON line is written (default check-gpu.json)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no part after this many seconds (default 420: the run then ends within ~8 minutes)")
    p.add_argument("--experts", type=int, default=32,
                   help="routed experts a layer of the model part (default 32: see rackserve/gpu_check/model.py)")
    p.add_argument("--small", action="store_true",
                   help="CPU, tiny shapes, Triton's interpreter: the same code paths, no meaningful timings")


def add_parser(sub) -> None:
    """Add `check-gpu` to the `rackserve` subcommands `sub`."""
    p = sub.add_parser("check-gpu", help="validate a GPU machine in one command: kernels, FP8/FP4 weights, NIXL, a "
                                         "4-layer V4-Flash-shaped model (--small: the same on CPU)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def _interpreter_ready() -> str | None:
    """Turn the Triton interpreter on for --small; why it cannot be, if triton already chose the GPU."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        return "--small needs the Triton interpreter, which triton picks when first imported; run it in a fresh process"
    os.environ["TRITON_INTERPRET"] = "1"
    return None


def _run(part, fn) -> None:
    """Run one part, recording its outcome in `part`."""
    from rackserve.gpu_check.report import FAILED, OK

    t0 = time.perf_counter()
    try:
        part.figures, failures = fn()
        part.status = FAILED if failures else OK
        part.reason = "; ".join(failures)
    except Exception as e:  # a part that raises is reported failed; the others still run
        traceback.print_exc()
        part.fail(f"{type(e).__name__}: {e}")
    part.seconds = time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    """The check, for parsed arguments; its exit status."""
    if args.small and (why := _interpreter_ready()) is not None:
        print(f"rackserve check-gpu: {why}", file=sys.stderr)
        return 2
    import torch

    if not args.small and not torch.cuda.is_available():
        print("rackserve check-gpu: needs a CUDA GPU, and torch sees none here (torch.cuda.is_available() is False); "
              "`rackserve check-gpu --small` runs the same code paths on CPU with tiny shapes", file=sys.stderr)
        return 2
    from rackserve.gpu_check.kernels import check_kernels, check_weight_kernels
    from rackserve.gpu_check.model import check_model
    from rackserve.gpu_check.report import SKIPPED, Part, Setup, dumps, headline, summary
    from rackserve.gpu_check.transfer import check_nixl

    setup = Setup(small=args.small)
    runs = {"kernels": lambda: check_kernels(setup), "weights": lambda: check_weight_kernels(setup),
            "nixl": lambda: check_nixl(setup), "model": lambda: check_model(setup, args.experts)}
    start = time.perf_counter()
    parts = [Part(name, title) for name, title in PARTS]
    print(f"rackserve check-gpu on {setup.device_name}" + (": --small, tiny shapes, timings mean nothing"
                                                             if setup.small else ""))
    for i, part in enumerate(parts, 1):
        elapsed = time.perf_counter() - start
        print(f"\n== {i}/{len(parts)} {part.name}: {part.title} ==", flush=True)
        if elapsed > args.budget_s:
            part.status, part.reason = SKIPPED, f"budget of {args.budget_s:g} s spent ({elapsed:.1f} s)"
            print(f"skipped: {part.reason}")
            continue
        _run(part, runs[part.name])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next part starts from a clean device
    figures = headline(setup, parts, time.perf_counter() - start, args.budget_s)
    print(f"\n{summary(parts)}")
    line = dumps(figures)
    Path(args.out).write_text(line + "\n")
    print(f"(written to {args.out})\n{line}")
    return 0 if figures["ok"] else 1

