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
    # n > 1 (SamplingParams.n): the request's choices all share its request id; `choices` lists them
    # (the same list in each; [self] when n = 1). The first one prefills the prompt but its last token
    # (`fork_at`), then the others (`forks`, held by it until then) start from a copy of its state
    index: int = 0
    choices: list[Request] = field(default_factory=list)
    forks: list[Request] = field(default_factory=list)
    fork_at: int | None = None

    def __post_init__(self) -> None:
        self.token_ids = [*self.prompt_ids, *self.resumed]
        self.choices = self.choices or [self]

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_given(self) -> int:
        """Tokens known at admission, all to prefill: the prompt and the resumed output."""
        return len(self.prompt_ids) + len(self.resumed)

    @property
    def num_pushed(self) -> int:
        """Tokens whose state a prefill rank pushes for it: what it was given, or with n > 1 the tokens
        its choices share (they fork on the decode rank, each sampling its own first token)."""
        return self.num_given if self.fork_at is None else self.fork_at

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

    @property
    def all_finished(self) -> bool:
        """Whether every choice of the request has finished."""
        return all(c.finished for c in self.choices)


@dataclass
class RequestOutput:
    """What one step produced for one choice of a request: only the new tokens and text (streaming deltas).

    The same object goes from the engine through a DP rank actor (pickled by Ray) to the client that
    streams it. `error`: why the rank refused the request (finished, finish reason "error", nothing
    generated); None otherwise. Token counts are totals so far: prompt, served from a prefix cache,
    generated (by this choice). `index`: the choice (SamplingParams.n); `finish_reason` is set on a
    choice's last output, `finished` on the request's (every choice has finished: the stream ends)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "pushed" | "error", once the choice finished
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    index: int = 0


@dataclass
class Completion:
    """A finished choice of a request, as every `generate` returns it (`LLM`, `Instance`, `Deployment`):
    one per prompt, or with n > 1 its n choices one after another in `index` order.

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
    index: int = 0

    @classmethod
    def from_outputs(cls, request_id: str, prompt_token_ids: list[int], outputs: Iterable[RequestOutput],
                     logprobs: bool = False) -> list[Completion]:
        """The completions of a request's choices from its outputs in order, in `index` order (one when
        n = 1): each choice's deltas joined, the counts of its last; `logprobs`: whether they were asked
        for. A choice whose outputs end before its finish reason (the request was aborted) gives
        "abort"."""
        by_choice: dict[int, list[RequestOutput]] = {}
        for out in outputs:
            by_choice.setdefault(out.index, []).append(out)
        completions = []
        for index, outs in sorted((by_choice or {0: []}).items()):
            last = outs[-1] if outs else None
            completions.append(cls(
                request_id, prompt_token_ids, [t for o in outs for t in o.new_token_ids],
                "".join(o.new_text for o in outs),
                last.finish_reason if last is not None and last.finish_reason is not None else "abort",
                num_cached_tokens=last.num_cached_tokens if last is not None else 0,
                logprobs=[e for o in outs for e in o.new_logprobs] if logprobs else None,
                error=last.error if last is not None else None, index=index))
        return completions
