"""A request as the engine tracks it, and the outputs it streams back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rackserve.engine.detokenizer import IncrementalDetokenizer
from rackserve.engine.sampling import SamplingParams
from rackserve.engine.state_cache import CacheHandle
from rackserve.transfer.kv import KVReservation


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    """The chosen token's log-probability and the top-n alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the effective RNG seed (drawn by the engine when params.seed is None)
    arrival: int  # admission order, for fairness
    eos_ids: tuple[int, ...] = ()
    detokenizer: IncrementalDetokenizer | None = None
    token_ids: list[int] = field(init=False)  # prompt + output so far
    num_computed: int = 0  # tokens whose state is in the cache
    num_cached: int = 0  # prompt tokens served by the prefix cache at first admission
    handle: CacheHandle | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "pushed" (prefill done, state sent)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_preemptions: int = 0
    push_to: KVReservation | None = None  # prefill only, then push the state to this decode rank
    draft_ids: list[int] = field(default_factory=list)  # speculative decoding: tokens to verify next step

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    """What one step produced for one request: only the new tokens and text (streaming deltas)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


@dataclass
class Completion:
    """A finished request, as `LLM.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
