"""A request as the engine tracks it, and the outputs it streams back."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from rackserve.engine.detokenizer import IncrementalDetokenizer
from rackserve.engine.grammar import Matcher
from rackserve.engine.sampling import SamplingParams
from rackserve.engine.state_cache import CacheHandle
from rackserve.transfer.transport import KVReservation


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
    resumed: list[int] = field(default_factory=list)  # output generated before a replay, resumed from here
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences (penalties.bad_word_ids)
    detokenizer: IncrementalDetokenizer | None = None
    matcher: Matcher | None = None  # with params.structured: where its output is in the grammar
    token_ids: list[int] = field(init=False)  # prompt + output so far
    num_computed: int = 0  # tokens whose state is in the cache, or will be once the scheduled steps ran
    num_pending: int = 0  # tokens sampled by scheduled steps, not yet in token_ids
    num_cached: int = 0  # prompt tokens served by the prefix cache at first admission
    handle: CacheHandle | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "pushed" (prefill done, state sent)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_preemptions: int = 0
    push_to: KVReservation | None = None  # prefill only, then push the state to this decode rank
    draft_ids: list[int] = field(default_factory=list)  # speculative decoding: tokens to verify next step

    def __post_init__(self) -> None:
        self.token_ids = [*self.prompt_ids, *self.resumed]

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_given(self) -> int:
        """Tokens known at admission, all to prefill: the prompt and the resumed output."""
        return len(self.prompt_ids) + len(self.resumed)

    @property
    def num_known(self) -> int:
        """Tokens so far, the pending ones included."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    """What one step produced for one request: only the new tokens and text (streaming deltas).

    The same object goes from the engine through a DP rank actor (pickled by Ray) to the client that
    streams it. `error`: why the rank refused the request (finished, finish reason "error", nothing
    generated); None otherwise. Token counts are totals so far: prompt, served from a prefix cache,
    generated."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "pushed" | "error", once finished
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None


@dataclass
class Completion:
    """A finished request, as every `generate` returns it (`LLM`, `Instance`, `Deployment`).

    prompt_token_ids: the prompt as the engine took it ([] for text sent to a model without a
    tokenizer, which is refused); logprobs: per output token, when they were asked for, else None;
    error: why the request was refused (finish reason "error"), else None."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None

    @classmethod
    def from_outputs(cls, request_id: str, prompt_token_ids: list[int], outputs: Iterable[RequestOutput],
                     logprobs: bool = False) -> Completion:
        """The completion of a request from its outputs in order (their deltas joined, the counts of
        the last); `logprobs`: whether they were asked for. Outputs that end before a finished one
        (the request was aborted) give finish reason "abort"."""
        token_ids, text, entries, last = [], "", [], None
        for last in outputs:
            token_ids += last.new_token_ids
            text += last.new_text
            entries += last.new_logprobs
        finished = last is not None and last.finished
        return cls(request_id, prompt_token_ids, token_ids, text, last.finish_reason if finished else "abort",
                   num_cached_tokens=last.num_cached_tokens if last is not None else 0,
                   logprobs=entries if logprobs else None, error=last.error if last is not None else None)
