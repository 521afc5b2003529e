"""What `rackserve check-gpu` knows about a run: where it runs (`Setup`), each part's outcome (`Part`),
and the summary table and JSON line they end in."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field

import torch

OK, FAILED, SKIPPED = "ok", "failed", "skipped"


@dataclass(frozen=True)
class Setup:
    """Where the check runs. `small`: CPU, tiny shapes, Triton under its interpreter, timings meaningless;
    otherwise CUDA at V4-Flash's sizes, in bf16."""

    small: bool

    @property
    def device(self) -> str:
        return "cpu" if self.small else "cuda"

    @property
    def dtype(self) -> torch.dtype:
        # the interpreter checks the kernels' arithmetic in fp32 (as the kernel tests do); GPUs serve in bf16
        return torch.float32 if self.small else torch.bfloat16

    @property
    def timed(self) -> bool:
        return not self.small

    @property
    def device_name(self) -> str:
        return "CPU (Triton interpreter)" if self.small else torch.cuda.get_device_name()

    @functools.cached_property
    def ceilings(self) -> tuple[float, float]:
        """(device copy GB/s, bf16 matmul TFLOP/s), measured once (`rackserve.bench.kernels.ceilings`);
        the copy figure counts bytes read and written, as a kernel's achieved GB/s does."""
        from rackserve.bench.kernels import ceilings

        return ceilings(self.device)


@dataclass
class Part:
    """One part of the check: its outcome and the headline figures it adds to the JSON."""

    name: str
    title: str
    status: str = SKIPPED
    reason: str = ""  # why it failed or was skipped
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        self.status, self.reason = FAILED, reason

    def to_json(self) -> dict:
        return {"status": self.status, **({"reason": self.reason} if self.reason else {}),
                "seconds": round(self.seconds, 1), **self.figures}


def summary(parts: list[Part]) -> str:
    """The closing table: one line a part, its status, seconds and (when not ok) why."""
    lines = [f"{'part':<14} {'status':<8} {'seconds':>8}  reason", "-" * 60]
    lines += [f"{p.name:<14} {p.status:<8} {p.seconds:>8.1f}  {p.reason}" for p in parts]
    return "\n".join(lines)


def headline(setup: Setup, parts: list[Part], seconds: float, budget_s: float) -> dict:
    """The run as one JSON object: ok only when every part ran and passed."""
    return {"check": "gpu", "device": setup.device_name, "small": setup.small, "timings_meaningful": setup.timed,
            "ok": all(p.status == OK for p in parts), "seconds": round(seconds, 1), "budget_s": budget_s,
            "parts": {p.name: p.to_json() for p in parts}}


def dumps(figures: dict) -> str:
    """One line of JSON; non-finite floats (an error of inf) as strings, so the line stays valid JSON."""
    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return value
    return json.dumps(clean(figures))
