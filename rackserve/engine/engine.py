"""The engine: one model, its state cache, a scheduler and a runner. A step is three lines."""

from __future__ import annotations

import itertools
import random
from dataclasses import asdict

import numpy as np
import torch

from rackserve.config import EngineConfig
from rackserve.engine.detokenizer import IncrementalDetokenizer
from rackserve.engine.gang import ExpertBalancer, Gang, sync
from rackserve.engine.request import Request, RequestOutput
from rackserve.engine.runner import Runner
from rackserve.engine.sampling import SamplingParams
from rackserve.engine.scheduler import Scheduler
from rackserve.engine.state_cache import StateCache
from rackserve.model import DeepseekV4ForCausalLM
from rackserve.model.tokenizer import Tokenizer
from rackserve.timing import phase


class RequestError(ValueError):
    """A request the engine cannot take; the message says why and what to change."""


class Engine:
    def __init__(self, model: DeepseekV4ForCausalLM, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None, gang: Gang | None = None):
        """`gang`: when this engine is one DP rank of an instance whose MoE layers exchange tokens
        (expert parallel), the other ranks to step in lockstep with; see `step`."""
        self.model, self.tokenizer, self.gang = model, tokenizer, gang
        self.config = (config or EngineConfig()).resolve(model.config)
        c = self.config
        self.cache = StateCache(model.config, c.block_size, c.max_num_seqs, int(c.state_memory_mb * 2**20),
                                prefix_caching=c.prefix_caching, max_snapshots=c.prefix_snapshots,
                                dtype=model.dtype, device=model.lm_head.weight.device)
        if self.cache.pages_for(c.max_model_len) > self.cache.num_pages:
            raise ValueError(
                f"state_memory_mb={c.state_memory_mb} holds {self.cache.num_pages} pages of {c.block_size} tokens, "
                f"but one request of max_model_len={c.max_model_len} tokens needs "
                f"{self.cache.pages_for(c.max_model_len)}; raise state_memory_mb or lower max_model_len"
            )
        self.scheduler = Scheduler(self.config, self.cache)
        self.runner = Runner(model, self.cache)
        self.balancer = None
        if gang is not None:
            self.runner.dummy = self.cache.allocate()
            self.cache.reserve(self.runner.dummy, 1)
            self.balancer = ExpertBalancer(model.moe_layers, gang, c.eplb_interval, c.eplb_min_gain)
        self.gang_tokens = np.zeros(0, np.int64)  # tokens each gang member ran in the last step
        self._seeds = random.Random(c.seed)
        self._ids = itertools.count()
        self.eos_ids = tuple(model.config.eos_token_ids)
        self.num_steps = 0

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        """Queue a request (text needs a tokenizer); raises `RequestError` for input it cannot serve."""
        params = params or SamplingParams()
        if request_id is not None and self.scheduler.find(request_id) is not None:
            raise RequestError(f"request id {request_id!r} is already in use; ids must be unique while running")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer.json; send token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        vocab = self.model.config.vocab_size
        if not ids:
            raise RequestError("the prompt is empty; send at least one token")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab}) for this model")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; this engine's max_model_len is {limit} (prompt + output), "
                "so shorten the prompt"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; use stop_token_ids with a token-only model")
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop,
                                           skip_special_tokens=params.skip_special_tokens)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        req = Request(request_id or f"req-{next(self._ids)}", ids, params, seed, arrival=next(self._ids),
                      eos_ids=self.eos_ids, detokenizer=detok)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its state; False if it is not in the engine."""
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run, apply: one continuous-batching step.

        In a gang, a host sync between schedule and run (one all-reduce of a small int vector:
        tokens per rank, forward passes) makes every rank run the same number of forwards, dummy
        ones where it has no work, or all of them skip the step when no rank has work.
        """
        with phase("schedule"):
            out = self.scheduler.schedule()
            passes = self.runner.plan(out)
        num_passes = len(passes)
        if self.gang is not None:
            with phase("host sync"):
                self.gang_tokens, num_passes = sync(self.gang, out.num_tokens, num_passes)
        if num_passes == 0:
            return []
        with phase("forward other"):  # what attention, expert and sampling phases leave of the forward
            result = self.runner.execute(out, passes, num_passes)
        self.num_steps += 1
        with phase("update"):
            outputs = self.scheduler.update(out, result)
        if self.balancer is not None:
            with phase("eplb"):
                self.balancer.after_step()
        return outputs

    def stats(self) -> dict:
        """Counters: prefix-cache hits and skipped tokens, evictions, preemptions, state memory."""
        return {
            **asdict(self.cache.stats),
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.num_steps,
            "state_bytes_in_use": self.cache.bytes_in_use,
            "state_bytes_total": self.cache.bytes_total,
            **(self.balancer.stats() if self.balancer else {}),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
        }
