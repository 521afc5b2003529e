"""What a benchmark runs against through the Python API: a P/D `Deployment` or one colocated `Instance`.

    target = start("pd:1xDEP1:1xDEP1")     # prefill instances : decode instances (+ one KV store)
    target = start("colocated:DEP2")       # one instance that prefills and decodes its own requests

Both answer `submit(prompt, params, session) -> request id` and `astream(request id)`, as
`Deployment` does. `TargetSpec` counts their GPUs (ranks): every rank of every instance; the
decode GPUs are the decode instances' ranks, or all of them when colocated. KV stores live in host
memory and hold no GPU. `Deployment` needs at least one prefill instance, so "colocated" is an
`Instance` on its own: its ranks prefill with their local prefix cache and decode, and a session
sticks to one DP rank (chosen by a hash of its name) so that its history stays cached there.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from rackserve.cluster.deployment import Deployment
from rackserve.cluster.instance import Instance
from rackserve.engine import RequestOutput, SamplingParams
from rackserve.placement import InstanceGroup


@dataclass(frozen=True)
class TargetSpec:
    """A parsed "pd:PREFILL:DECODE" or "colocated:SHAPE" (shapes as the planner writes them)."""

    prefill: InstanceGroup | None
    decode: InstanceGroup

    @staticmethod
    def parse(text: str) -> TargetSpec:
        kind, *shapes = text.split(":")
        if kind == "pd" and len(shapes) == 2:
            return TargetSpec(InstanceGroup.parse(shapes[0], "prefill"), InstanceGroup.parse(shapes[1], "decode"))
        if kind == "colocated" and len(shapes) == 1:
            group = InstanceGroup.parse(shapes[0], "decode")
            if group.count != 1:
                raise ValueError(f"{text!r}: a colocated target is one instance; write colocated:{group.shape}")
            return TargetSpec(None, group)
        raise ValueError(f"target {text!r}: write pd:<prefill>:<decode> (e.g. pd:1xDEP1:1xDEP1) or "
                         "colocated:<shape> (e.g. colocated:DEP2)")

    @property
    def name(self) -> str:
        if self.prefill is None:
            return f"colocated {self.decode.shape}"
        return f"P/D {self.prefill.count}x{self.prefill.shape} + {self.decode.count}x{self.decode.shape}"

    @property
    def gpus(self) -> int:
        return self.decode_gpus + (self.prefill.count * self.prefill.gpus if self.prefill else 0)

    @property
    def decode_gpus(self) -> int:
        return self.decode.count * self.decode.gpus


class Colocated:
    """One instance serving requests end to end, with `Deployment`'s submit/astream."""

    def __init__(self, instance: Instance):
        self.instance = instance

    def submit(self, prompt: list[int], params: SamplingParams, session: str | None = None) -> str:
        rank = zlib.crc32(session.encode()) % self.instance.dep if session is not None else None
        return self.instance.submit(prompt, params, rank=rank)

    def astream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        return self.instance.astream(request_id)

    def shutdown(self) -> None:
        self.instance.shutdown()


def start(spec: TargetSpec | str, model: str = "tiny", engine: dict | None = None) -> Deployment | Colocated:
    """Start the target on the connected Ray cluster; `engine`: `EngineConfig` fields of every rank."""
    spec = TargetSpec.parse(spec) if isinstance(spec, str) else spec
    if spec.prefill is None:
        return Colocated(Instance(model, dep=spec.decode.size, expert_ranks=spec.decode.expert_ranks,
                                  engine_kwargs=engine, name="colocated"))
    return Deployment(model, prefill=f"{spec.prefill.count}x{spec.prefill.shape}",
                      decode=f"{spec.decode.count}x{spec.decode.shape}", kv_stores=1, engine_kwargs=engine)
