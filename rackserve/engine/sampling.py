"""Sampling: per-request parameters and one batched, seeded sampler.

`SamplingParams` is what a request asks for; `SamplingBatch.build` packs R requests' parameters
into tensors once per step; `sample(logits, batch)` picks one token per row with no Python loop
over rows. Filters run in the order temperature → top-k → top-p → min-p, then the Gumbel-max trick
draws a token. The Gumbel noise is a hash of (seed, counter, token id) only, so a seeded request
gets the same tokens whatever else is in its batch and whichever row it sits in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from rackserve.engine.grammar import GrammarSpec
from rackserve.engine.penalties import LogitAdjustments

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: ±100 bans or forces a token
MAX_REPETITION_PENALTY = 100.0  # far past any useful value (HF suggests ~1.2), bounded to catch typos
MAX_CHOICES = 128  # OpenAI's bound on n
_MAX_SEED = 2**63  # seeds are stored in int64


def _check_number(name: str, value: object, *, integer: bool = False) -> None:
    # bool is a subclass of int; `max_tokens=True` is a bug in the caller, not the number 1
    allowed = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed):
        kind = "an int" if integer else "a number"
        raise ValueError(f"{name}={value!r} must be {kind}, not {type(value).__name__}")


def _as_tuple(name: str, value: object, item_type: type) -> tuple:
    """`value` (one item, a list or a tuple) as a tuple, checking each item's type."""
    if isinstance(value, item_type) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}={value!r} must be a {item_type.__name__} or a list of {item_type.__name__}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, item_type):
            raise ValueError(f"{name} item {item!r} must be {item_type.__name__}, not {type(item).__name__}")
    return tuple(value)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted (token id, bias) pairs, from a dict (JSON object keys are strings of ids)
    or a sequence of pairs; ids ≥ 0 (the engine checks them against the vocabulary), |bias| ≤ 100."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        items = list(value)
    else:
        raise ValueError(f"logit_bias={value!r} must map token ids to biases, e.g. {{\"50256\": -100}}")
    pairs = {}
    for key, bias in items:
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ValueError(f"logit_bias key {key!r} is not a token id; use ids ≥ 0 as keys")
        _check_number(f"logit_bias[{key}]", bias)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{key}]={bias} is out of range; use -100 ≤ bias ≤ 100")
        pairs[key] = float(bias)
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. `temperature=0` is greedy; `top_k` of 0 or -1 disables top-k.

    `stop` strings end the output right before the first one that appears; `stop_token_ids` end it
    after that token. `logprobs=n` returns the chosen token's log-probability and the n most likely
    alternatives (from the model's distribution, before penalties, temperature and filters).

    What changes the logits before temperature and filters (`rackserve.engine.penalties`), in this
    order: `allowed_token_ids` (only these may be sampled), `bad_words` (never completed: a word's
    last token is banned where the output so far ends with the rest of it), `min_tokens` (EOS and
    `stop_token_ids` banned, stop strings not looked for, until that many tokens came out),
    `logit_bias` (token id → added to its logit, as OpenAI's), then vLLM's order of penalties:
    `repetition_penalty` (HF's: logits of tokens seen in prompt or output divided by it where positive,
    multiplied where negative), `frequency_penalty` (minus it × the token's count in the output) and
    `presence_penalty` (minus it once the token is in the output), OpenAI's definitions. Before all
    of them, `structured` (`rackserve.engine.grammar`) keeps only the tokens its grammar allows next.

    `n` choices share the prompt: it is prefilled once and each choice forks from that state
    (`rackserve.engine.scheduler`). Choice i draws with `seed + i`, so it is the same request alone
    with that seed (without a seed, each choice draws its own).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) sorted by id; a dict is taken too
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    structured: GrammarSpec | None = None  # a dict of its fields is taken too
    n: int = 1

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            _check_number(name, getattr(self, name))
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("top_k", "max_tokens", "min_tokens", "n"):
            _check_number(name, getattr(self, name), integer=True)
        # No upper bound on temperature: sample() subtracts the row max before dividing, so any
        # finite value works (a large one is simply close to uniform).
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature} is out of range; use a finite temperature ≥ 0 "
                             "(0 means greedy)")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} is out of range; use top_k ≥ 1, or 0 or -1 to disable it")
        if not 0 < self.top_p <= 1:  # also rejects NaN
            raise ValueError(f"top_p={self.top_p} is out of range; use 0 < top_p ≤ 1")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} is out of range; use 0 ≤ min_p ≤ 1")
        if self.seed is not None:
            _check_number("seed", self.seed, integer=True)
            if not 0 <= self.seed < _MAX_SEED:
                raise ValueError(f"seed={self.seed} is out of range; use 0 ≤ seed < 2**63")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} is out of range; use max_tokens ≥ 1")
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n={self.n} is out of range; use 1 ≤ n ≤ {MAX_CHOICES}")
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop, str))
        if "" in self.stop:
            raise ValueError(f"stop={list(self.stop)!r} contains an empty string; remove it")
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids, int))
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={list(self.stop_token_ids)} has a negative id; use ids ≥ 0")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:  # also rejects NaN
                raise ValueError(f"{name}={getattr(self, name)} is out of range; use -2 ≤ {name} ≤ 2 (0 is off)")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty={self.repetition_penalty} is out of range; use 0 < "
                             f"repetition_penalty ≤ {MAX_REPETITION_PENALTY} (1 is off, above 1 discourages repeats)")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is out of range; use 0 ≤ min_tokens ≤ max_tokens "
                             f"({self.max_tokens})")
        object.__setattr__(self, "bad_words", _as_tuple("bad_words", self.bad_words, str))
        if any(not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words={list(self.bad_words)!r} contains an empty word; remove it")
        if self.allowed_token_ids is not None:
            allowed = _as_tuple("allowed_token_ids", self.allowed_token_ids, int)
            if not allowed or min(allowed) < 0:
                raise ValueError(f"allowed_token_ids={list(allowed)} must list at least one id, all ≥ 0; "
                                 "send null to allow every token")
            object.__setattr__(self, "allowed_token_ids", allowed)
        if self.structured is not None:
            if not isinstance(self.structured, (GrammarSpec, dict)):
                raise ValueError(f"structured={self.structured!r} must be a GrammarSpec or a dict of its fields")
            object.__setattr__(self, "structured", GrammarSpec.from_dict(self.structured))
        if self.logprobs is not None:
            _check_number("logprobs", self.logprobs, integer=True)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs={self.logprobs} is out of range; use 0 ≤ logprobs ≤ {MAX_LOGPROBS} "
                                 "or None for no log-probabilities")

    def choice_seed(self, index: int) -> int | None:
        """The seed choice `index` draws with: `seed + index` (wrapping below 2**63); None without a seed."""
        return None if self.seed is None else (self.seed + index) % _MAX_SEED

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the request's history (counts of its tokens so far)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes this request's logits before temperature and filters."""
        return bool(self.penalized or self.logit_bias or self.min_tokens or self.bad_words
                    or self.allowed_token_ids is not None or self.structured is not None)

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """Parameters from a plain dict (e.g. a request body); unknown keys are an error."""
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(allowed))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; allowed: {allowed}")
        return cls(**d)


@dataclass
class SamplingBatch:
    """R requests' sampling parameters as tensors on the logits' device.

    temperature [R] f32 (0 = greedy), top_k [R] int64 (0 = off), top_p [R] f32, min_p [R] f32,
    seed [R] int64, counter [R] int64 (index of the token being sampled within its request),
    max_logprobs: the largest `logprobs` over rows, or -1 when no row wants log-probabilities;
    adjust: what penalties, biases and bans do to the rows' logits first (None: nothing).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    counter: torch.Tensor
    max_logprobs: int
    adjust: LogitAdjustments | None = None

    @classmethod
    def build(cls, params_list: list[SamplingParams], seeds: list[int], counters: list[int],
              device: torch.device | str = "cpu", adjust: LogitAdjustments | None = None) -> SamplingBatch:
        """Pack one step's rows. `seeds` are effective seeds (the engine picks one for unseeded requests)."""
        if not len(params_list) == len(seeds) == len(counters):
            raise ValueError(f"build got {len(params_list)} params, {len(seeds)} seeds and {len(counters)} counters; "
                             "pass one of each per row")

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        wanted = [p.logprobs for p in params_list if p.logprobs is not None]
        return cls(
            temperature=tensor([p.temperature for p in params_list], torch.float32),
            top_k=tensor([max(p.top_k, 0) for p in params_list], torch.int64),
            top_p=tensor([p.top_p for p in params_list], torch.float32),
            min_p=tensor([p.min_p for p in params_list], torch.float32),
            seed=tensor(seeds, torch.int64),
            counter=tensor(counters, torch.int64),
            max_logprobs=max(wanted, default=-1),
            adjust=adjust,
        )


@dataclass
class SampleOutput:
    """token_ids [R] int64; logprobs [R] f32 of the chosen tokens under the raw model distribution;
    top_ids / top_logprobs [R, max_logprobs] sorted by descending log-probability, or None."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    accepted: torch.Tensor | None = None  # [R] bool, with drafts: whether the row's draft was kept


# splitmix64 (Steele et al., 2014): a counter-based generator whose output i is mix(seed + i·γ).
def _signed(c: int) -> int:
    return c - 2**64 if c >= 2**63 else c


_GAMMA = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` on int64 is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 bit patterns (products wrap mod 2**64, as in C)."""
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def uniform(seed: torch.Tensor, counter: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float64 uniforms in (0, 1), a pure function of (seed[r], counter[r], token id).

    Row r is the splitmix64 stream keyed by (seed, counter); its 52 top bits become the odd
    multiple (2m + 1) / 2**53, which is exact in float64 and never 0 or 1.
    """
    row_key = mix64(mix64(seed) + (counter + 1) * _GAMMA)  # [R]
    token = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seed.device)
    bits = mix64(row_key[:, None] + token[None, :] * _GAMMA)  # [R, V]
    return (_shr(bits, 12) * 2 + 1).double() * 2.0**-53


def filter_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor) -> torch.Tensor:
    """[R, V] bool, True for the tokens top-k, then top-p, then min-p keep.

    scaled [R, V]: temperature-scaled logits. top-k keeps exactly k tokens, lower id first among
    equal logits (so top_k=1 is argmax); top-p keeps the shortest most-likely prefix whose
    probability (renormalised after top-k) reaches top_p; min-p drops tokens below min_p × the
    top probability. The top token always survives.
    """
    vocab = scaled.shape[-1]
    # one stable sort for all three filters; stable keeps ties in token-id order
    values, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    keep = rank[None, :] < k[:, None]
    probs = values.masked_fill(~keep, -math.inf).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p = 1 keeps everything, even where float rounding makes the cumulative sum reach 1 early
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    # ratios to the top probability are unchanged by renormalising after top-p
    keep &= probs >= min_p[:, None] * probs[:, :1]
    return torch.zeros_like(keep).scatter_(1, order, keep)


def sample(logits: torch.Tensor, batch: SamplingBatch, drafts: torch.Tensor | None = None) -> SampleOutput:
    """One token per row. logits [R, V] float32 → SampleOutput (see its docstring for shapes).

    drafts [R] int64 (-1: none): a proposed token per row, from a deterministic draft model
    (speculative decoding). A greedy row keeps its draft iff it is the argmax. A sampling row keeps
    draft x with probability p(x) (p: the row's filtered distribution; this is the rejection
    rule min(1, p/q) for a one-hot q), and otherwise draws from p with x removed, renormalised:
    either way the token is distributed as p. Acceptance compares the row's uniform of token x
    with p(x), and the redraw's Gumbel noise uses the other tokens' uniforms only, so the two are
    independent and the row stays a pure function of (seed, counter). Penalties, biases and bans
    (`batch.adjust`) change the logits that greedy rows take the argmax of and sampling rows sample
    from, so verification stays exact under them; logprobs stay the model's.
    """
    logits = logits.float()
    raw_logprobs = logits.log_softmax(dim=-1)
    if batch.adjust is not None:
        logits = batch.adjust.apply(logits)
    token_ids = logits.argmax(dim=-1)
    accepted = None if drafts is None else token_ids == drafts
    # only rows that sample pay for the sort, the filters and the [rows, V] noise
    rows = (batch.temperature > 0).nonzero().squeeze(1)
    if rows.numel():
        sub = logits[rows]
        # subtracting the row max first keeps tiny temperatures finite: the top logit becomes 0, not inf
        scaled = (sub - sub.amax(dim=-1, keepdim=True)) / batch.temperature[rows, None]
        keep = filter_mask(scaled, batch.top_k[rows], batch.top_p[rows], batch.min_p[rows])
        u = uniform(batch.seed[rows], batch.counter[rows], logits.shape[-1])
        masked = scaled.double().masked_fill(~keep, -math.inf)
        if drafts is not None:
            draft = drafts[rows]
            col = draft.clamp(min=0)[:, None]
            p_draft = masked.softmax(dim=-1).gather(1, col).squeeze(1)
            kept = (draft >= 0) & (u.gather(1, col).squeeze(1) < p_draft)
            masked = torch.where((draft >= 0)[:, None], masked.scatter(1, col, -math.inf), masked)
            accepted[rows] = kept
        # Gumbel-max: argmax(scaled + Gumbel noise) is a draw from softmax(scaled) over the kept tokens
        drawn = (masked - (-u.log()).log()).argmax(dim=-1)
        token_ids[rows] = drawn if drafts is None else torch.where(kept, draft, drawn)
    out = SampleOutput(token_ids, raw_logprobs.gather(1, token_ids[:, None]).squeeze(1), accepted=accepted)
    if batch.max_logprobs >= 0:
        n = min(batch.max_logprobs, logits.shape[-1])
        out.top_logprobs, out.top_ids = raw_logprobs.topk(n, dim=-1)
    return out
