"""The engine: one model, its state cache, a scheduler and a runner. A step is three lines."""

from __future__ import annotations

import itertools
import random
from dataclasses import asdict

import torch

from rackserve.config import EngineConfig
from rackserve.engine.detokenizer import IncrementalDetokenizer
from rackserve.engine.request import Request, RequestOutput
from rackserve.engine.runner import Runner
from rackserve.engine.sampling import SamplingParams
from rackserve.engine.scheduler import Scheduler
from rackserve.engine.state_cache import StateCache
from rackserve.model import DeepseekV4ForCausalLM
from rackserve.model.tokenizer import Tokenizer


class RequestError(ValueError):
    """A request the engine cannot take; the message says why and what to change."""


class Engine:
    def __init__(self, model: DeepseekV4ForCausalLM, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None):
        self.model, self.tokenizer = model, tokenizer
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
        """Schedule, run, apply: one continuous-batching step."""
        out = self.scheduler.schedule()
        result = self.runner.execute(out)
        self.num_steps += 1
        return self.scheduler.update(out, result)

    def stats(self) -> dict:
        """Counters: prefix-cache hits and skipped tokens, evictions, preemptions, state memory."""
        return {
            **asdict(self.cache.stats),
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.num_steps,
            "state_bytes_in_use": self.cache.bytes_in_use,
            "state_bytes_total": self.cache.bytes_total,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
        }
