"""`DPRank`: one data-parallel rank of a DEP instance, holding its share of the routed experts.

The actor adds only what the engine cannot know: its rank, the process groups (Gloo/NCCL for the
expert all-to-all, `rackserve.collective` for the per-step host sync), and a step loop in a
background thread. Requests come in through `submit`, outputs go out through `poll`.
Idle protocol: when a step's host sync shows no rank with work, every rank blocks until woken;
`Instance` wakes every rank whenever it submits to any, so all ranks resume together.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

from rackserve.collective import join
from rackserve.config import EngineConfig
from rackserve.engine import Engine, SamplingParams
from rackserve.model import load_model
from rackserve.model.tokenizer import Tokenizer
from rackserve.transfer.ep import ExpertParallel


class DPRank:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.engine: Engine | None = None
        self._lock = threading.Condition()
        self._inbox: list[tuple] = []
        self._outputs: dict[str, list[dict]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._error: str | None = None

    def endpoint(self) -> tuple[str, int]:
        """A (host, free port) for the expert-parallel process group's rendezvous (rank 0's is used)."""
        host = socket.gethostbyname(socket.gethostname())
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def setup(self, checkpoint: str, engine_kwargs: dict, phy2log: list[list[int]], slots_per_rank: int,
              dist_url: str, rendezvous_at: tuple[str, int], secret: str, timeout: float) -> None:
        """Join both groups, load the model with this rank's expert slots, start the step loop.
        `timeout` (s): how long a peer may stay silent before this rank gives up on the gang."""
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method=dist_url,
                                rank=self.rank, world_size=self.world_size, timeout=timedelta(seconds=timeout))
        gang = join(tuple(rendezvous_at), self.rank, self.world_size, secret, timeout=timeout)
        model = load_model(checkpoint, dtype=engine_kwargs.get("dtype"), device=engine_kwargs.get("device", "cpu"))
        ep = ExpertParallel(slots_per_rank)
        for layer, row in zip(model.model.layers, phy2log, strict=True):
            layer.mlp.shard(ep, torch.tensor(row))
        tokenizer = Tokenizer(checkpoint) if (checkpoint and _has_tokenizer(checkpoint)) else None
        self.engine = Engine(model, tokenizer, EngineConfig(**engine_kwargs), gang=gang)
        threading.Thread(target=self._loop, daemon=True, name=f"dp-rank-{self.rank}").start()

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int], params: dict) -> None:
        """Queue a request; raises here (not in the loop) for input the engine cannot take."""
        sampling = SamplingParams.from_dict(params)
        with self._lock:
            self._inbox.append(("add", request_id, prompt, sampling))
            self._outputs[request_id] = []
        self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def poll(self, request_id: str, timeout: float = 1.0) -> list[dict]:
        """Outputs of `request_id` since the last poll (waits up to `timeout` s for the first)."""
        with self._lock:
            self._lock.wait_for(lambda: self._outputs.get(request_id) or self._error, timeout)
            if self._error:
                raise RuntimeError(f"DP rank {self.rank} of {self.world_size} stopped: {self._error}")
            outs = self._outputs.get(request_id, [])
            if outs and outs[-1]["finished"]:
                del self._outputs[request_id]
            else:
                self._outputs[request_id] = []
            return outs

    def stats(self) -> dict:
        return {"rank": self.rank, **self.engine.stats()}

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()

    # ---- the step loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                self._drain_inbox()
                outputs = engine.step()
                with self._lock:
                    for out in outputs:
                        if out.request_id in self._outputs:
                            self._outputs[out.request_id].append(asdict(out))
                    self._lock.notify_all()
                if not engine.gang_tokens.any():  # no rank had work: sleep until someone submits
                    self._wake.wait()
                    self._wake.clear()
                    if self._stop:
                        break
        except Exception as e:  # a dead peer or transport error: fail the waiting callers clearly
            with self._lock:
                self._error = (f"the DEP gang failed ({type(e).__name__}: {e}); its in-flight requests are lost "
                               "and the instance must be restarted")
                self._lock.notify_all()

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
                        self._outputs[request_id].append({"request_id": request_id, "finished": True,
                                                          "finish_reason": "error", "error": str(e),
                                                          "new_text": "", "new_token_ids": []})
            else:
                self.engine.abort(item[1])


def _has_tokenizer(path: str) -> bool:
    from pathlib import Path

    return (Path(path) / "tokenizer.json").is_file()
