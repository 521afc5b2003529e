"""`DPRank`: one data-parallel (attention) rank of an instance, a thin actor over `Engine`.

In DEP mode it also holds its share of the routed experts; in attention–FFN split mode it holds
none and its MoE layers send every token to the expert ranks. Requests come in through `submit`,
outputs go out through `poll`.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from rackserve.actors.gang_member import GangMember, GangSpec
from rackserve.engine import Engine, SamplingParams
from rackserve.model.tokenizer import Tokenizer


class DPRank(GangMember):
    role = "DP rank"

    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size)
        self.engine: Engine | None = None
        self._inbox: list[tuple] = []
        self._outputs: dict[str, list[dict]] = {}

    def setup(self, spec: GangSpec) -> None:
        """Join the gang, load the model with this rank's expert slots, start the step loop."""
        model, config = self._join(spec)
        tokenizer = Tokenizer(spec.checkpoint) if (Path(spec.checkpoint) / "tokenizer.json").is_file() else None
        self.engine = Engine(model, tokenizer, config, gang=self.gang)
        self._start()

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int], params: dict) -> None:
        """Queue a request; raises here (not in the loop) for parameters the engine cannot take."""
        sampling = SamplingParams.from_dict(params)
        if self.error:  # the caller learns now, before the request is lost
            raise RuntimeError(self.error)
        with self._lock:
            self._inbox.append(("add", request_id, prompt, sampling))
            self._outputs[request_id] = []
        self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._outputs.pop(request_id, None)
        self._wake.set()

    def poll(self, request_id: str, timeout: float = 1.0) -> list[dict]:
        """Outputs of `request_id` since the last poll (waits up to `timeout` s for the first)."""
        with self._lock:
            self._lock.wait_for(lambda: self._outputs.get(request_id) or self.error, timeout)
            if self.error:
                raise RuntimeError(self.error)
            outs = self._outputs.get(request_id, [])
            if outs and outs[-1]["finished"]:
                del self._outputs[request_id]
            else:
                self._outputs[request_id] = []
            return outs

    def _stats(self) -> dict:
        return self.engine.stats()

    # ---- the step loop ---------------------------------------------------------------------------
    def _step(self) -> bool:
        self._drain_inbox()
        outputs = self.engine.step()
        with self._lock:
            for out in outputs:
                if out.request_id in self._outputs:
                    self._outputs[out.request_id].append(asdict(out))
            self._lock.notify_all()
        return bool(self.engine.gang_tokens.any()) or self.engine.gang_busy

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if item[0] == "add":
                _, request_id, prompt, sampling = item
                try:
                    self.engine.add_request(prompt, sampling, request_id=request_id)
                except ValueError as e:
                    with self._lock:
                        self._outputs.get(request_id, []).append({"request_id": request_id, "finished": True,
                                                          "finish_reason": "error", "error": str(e),
                                                          "new_text": "", "new_token_ids": []})
            else:
                self.engine.abort(item[1])
