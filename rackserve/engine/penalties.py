"""What a request's history, biases and bans do to its logits before temperature and filters.

`LogitAdjustments.apply` changes a step's sampling rows `[R, V]` in one pass of batched tensor ops
(no loop over rows), in this order: the grammar's bitmask (structured outputs), `allowed_token_ids`, bans (`bad_words`, and EOS / stop ids
under `min_tokens`), `logit_bias`, then the penalties in vLLM's order: repetition (HF's: seen
tokens' logits divided by it where positive, multiplied where negative), frequency, presence.

The penalties need each request's token counts. `TokenHistory` keeps them on the device, a row per
running request — output counts `[rows, V]` int32 and "seen in prompt or output" `[rows, V]` bool — so a
step reads them without a pass over the history, and a token still pending on the host (sampled
by the step in flight, with async scheduling) is counted from the device's input ids. Drafts are
never counted there: a row verifying draft i adds drafts 0 … i-1 to its own copy, so rejected
drafts need no undo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rackserve.timing import phase

if TYPE_CHECKING:
    from rackserve.engine.request import Request

ANY = -2  # in a bad word's padded prefix: matches any token (the word is shorter than the pad)
NOT_OUTPUT = -1  # in a row's tail: a prompt position, where no bad word may match


@dataclass
class ChunkRows:
    """The sampling rows of one request in a step, as the runner knows them on the host.

    Tokens `[0, end)` of the request come before its first row's sampled token, draft i before row
    i + 1's; `pending` maps the positions among them not yet known on the host to their rows in the
    forward's input ids; `first_row`: index of the chunk's first row among the step's sampling rows.
    """

    request: Request
    end: int
    drafts: list[int]
    first_row: int
    pending: dict[int, int] = field(default_factory=dict)


def _ids(values: list, device, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


class TokenHistory:
    """A row per penalised request that samples: counts [rows, V] int32 of its output tokens, seen
    [rows, V] bool of tokens in its prompt or output, on the device (allocated when a penalised
    request first samples). `rows`: the most requests that run at once (`max_num_seqs`); a row is
    taken over from a request that no longer runs (finished or preempted: no state handle).

    On the host, per row, the request it belongs to and how many of its tokens it covers: `plan`
    writes what the device must add (tokens known since, pending ones) and `CatchUp.apply` adds it
    on the forward thread, in step order, before the rows are read.
    """

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device | str):
        self.num_rows, self.vocab_size, self.device = num_rows, vocab_size, device
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self._owner: list[Request | None] = [None] * num_rows  # the object itself: ids get reused
        self._covered = [0] * num_rows  # tokens of the owner the device rows count
        self._rows: dict[int, int] = {}  # id(owner) -> its row

    @staticmethod
    def bytes_for(num_rows: int, vocab_size: int) -> int:
        """Device bytes of the counts and flags of `num_rows` rows."""
        return num_rows * vocab_size * (4 + 1)

    def row(self, req: Request) -> int:
        """The row of `req` (planned in this step)."""
        return self._rows[id(req)]

    def _take_row(self, req: Request, busy: set[int]) -> int:
        """A row for `req`, new here: a free one, or one whose request no longer runs and is not
        among this step's (`busy`: their ids)."""
        row = next((r for r, owner in enumerate(self._owner) if owner is None
                    or (owner.handle is None and id(owner) not in busy)), None)
        if row is None:
            raise RuntimeError(f"all {self.num_rows} penalty rows belong to running requests; more requests "
                               "sample at once than max_num_seqs")
        if self._owner[row] is not None:
            del self._rows[id(self._owner[row])]
        self._owner[row], self._covered[row] = req, 0
        self._rows[id(req)] = row
        return row

    def plan(self, chunks: list[ChunkRows]) -> CatchUp:
        """What brings the rows of `chunks`' requests up to their `end` (the host's view advances now)."""
        if self.counts is None:
            self.counts = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.int32, device=self.device)
            self.seen = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.bool, device=self.device)
        reset, known, pending = [], [[], [], []], [[], []]
        busy = {id(c.request) for c in chunks}
        for c in chunks:
            req = c.request
            row = self._rows.get(id(req))
            if row is None or self._owner[row] is not req:  # a request new to the history
                row = self._take_row(req, busy)
                reset.append(row)
            start, end = self._covered[row], c.end
            for pos in range(start, end):
                if pos in c.pending:
                    pending[0].append(row)
                    pending[1].append(c.pending[pos])
                else:
                    known[0].append(row)
                    known[1].append(req.token_ids[pos])
                    known[2].append(pos >= req.num_prompt)
            self._covered[row] = max(start, end)
        d = self.device
        return CatchUp(self, _ids(reset, d), _ids(known[0], d), _ids(known[1], d), _ids(known[2], d, torch.bool),
                       _ids(pending[0], d), _ids(pending[1], d))


@dataclass
class CatchUp:
    """Device writes that bring `history` up to date: its rows `reset` [Z] zeroed; known tokens
    (history row [K], token [K], is_output [K]) and pending ones (history row [P], row of the input
    ids [P]) added."""

    history: TokenHistory
    reset: torch.Tensor
    owners: torch.Tensor
    tokens: torch.Tensor
    is_output: torch.Tensor
    pending_owners: torch.Tensor
    pending_inputs: torch.Tensor

    def apply(self, input_ids: torch.Tensor) -> None:
        """Add the tokens; `input_ids` [T]: the forward's, its pending tokens filled in."""
        h = self.history
        if self.reset.numel():
            h.counts[self.reset] = 0
            h.seen[self.reset] = False
        owners = torch.cat([self.owners, self.pending_owners])
        tokens = torch.cat([self.tokens, input_ids[self.pending_inputs].long()])
        # a pending token is always an output: only a decode's last token is sampled by the step in flight
        is_output = torch.cat([self.is_output, torch.ones_like(self.pending_owners, dtype=torch.bool)])
        h.counts.index_put_((owners, tokens), is_output.int(), accumulate=True)
        h.seen[owners, tokens] = True


@dataclass
class LogitAdjustments:
    """One step's changes to its sampling rows' logits [R, V]; each part None when no row has it.

    grammar: (rows [G], bitmask [G, ceil(V / 32)] int32): those rows keep only the tokens whose bit is set.
    allowed: (rows [A], ids [A], restricted [R] bool): restricted rows keep only their listed ids.
    bans: (rows [B], ids [B]). bias: (rows [N], ids [N], values [N] f32).
    words: multi-token bad words, (rows [W], prefix [W, L] right-aligned with ANY padding, last [W],
    tail_values [W, L], tail_inputs [W, L]): a word's last token is banned where its row's last L
    tokens equal its prefix; the tail is `tail_values`, or input id `tail_inputs` where ≥ 0 (pending).
    penalties: rows [P], their history rows [P], presence / frequency / repetition [P] f32, and the drafts each
    row follows, (row index into P [D], token [D]).
    catch_up: the history's writes, run first (`prepare`).
    """

    input_ids: torch.Tensor
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    bans: tuple[torch.Tensor, torch.Tensor] | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    words: tuple[torch.Tensor, ...] | None = None
    penalties: tuple[torch.Tensor, ...] | None = None
    catch_up: CatchUp | None = None  # with penalties

    def prepare(self) -> None:
        """On the forward thread, once the input ids' pending tokens are filled in: the history's writes."""
        if self.catch_up is not None:
            self.catch_up.apply(self.input_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V] float32 → the adjusted logits (a new tensor)."""
        logits = logits.clone()
        if self.grammar is not None:
            with phase("grammar"):
                rows, bitmask = self.grammar
                bits = (bitmask[:, :, None] >> torch.arange(32, device=bitmask.device, dtype=torch.int32)) & 1
                keep = bits.reshape(len(rows), -1)[:, :logits.shape[-1]].bool()
                logits[rows] = logits[rows].masked_fill(~keep, -math.inf)
        if self.allowed is not None:
            rows, ids, restricted = self.allowed
            keep = ~restricted[:, None].expand_as(logits)
            keep[rows, ids] = True
            logits.masked_fill_(~keep, -math.inf)
        bans_rows, bans_ids, bans_add = [], [], []
        if self.bans is not None:
            bans_rows.append(self.bans[0])
            bans_ids.append(self.bans[1])
            bans_add.append(torch.full(self.bans[0].shape, -math.inf, device=logits.device))
        if self.words is not None:
            rows, prefix, last, tail_values, tail_inputs = self.words
            tail = torch.where(tail_inputs >= 0, self.input_ids[tail_inputs.clamp(min=0)].long(), tail_values)
            match = ((tail == prefix) | (prefix == ANY)).all(dim=-1)
            bans_rows.append(rows)
            bans_ids.append(last)
            # adding 0 or -inf, accumulated: two words with the same last token cannot undo each other
            bans_add.append(torch.where(match, -math.inf, 0.0))
        if bans_rows:
            logits.index_put_((torch.cat(bans_rows), torch.cat(bans_ids)), torch.cat(bans_add), accumulate=True)
        if self.bias is not None:
            rows, ids, values = self.bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if self.penalties is not None:
            logits = self._penalize(logits)
        return logits

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        rows, owners, presence, frequency, repetition, draft_rows, draft_ids = self.penalties
        history = self.catch_up.history
        counts = history.counts[owners]  # [P, V]
        if draft_rows.numel():
            counts.index_put_((draft_rows, draft_ids), torch.ones_like(draft_ids, dtype=counts.dtype), accumulate=True)
        seen = history.seen[owners] | (counts > 0)
        sub = logits[rows]
        rep = repetition[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - frequency[:, None] * counts - presence[:, None] * (counts > 0)
        logits[rows] = sub
        return logits


def bad_word_ids(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences, as vLLM bans them: the word alone and after a space (the forms it
    takes at the start of a text and inside one), without duplicates."""
    out: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_bos=False))
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def build_adjustments(chunks: list[ChunkRows], num_rows: int, input_ids: torch.Tensor,
                      history: TokenHistory) -> LogitAdjustments | None:
    """The adjustments of a step's sampling rows (`num_rows` of them; `chunks`: those of requests
    whose parameters adjust logits), or None when there are none. A structured request's rows get
    their grammar's masks, each after the drafts before it (its matcher is left where it was)."""
    chunks = [c for c in chunks if c.request.params.adjusts_logits]
    if not chunks:
        return None
    device = input_ids.device
    out = LogitAdjustments(input_ids)
    allowed, bans, bias = [[], []], [[], []], [[], [], []]
    restricted = [False] * num_rows
    words: list[tuple[int, tuple[int, ...], list[int], list[int]]] = []  # row, word, tail values, tail inputs
    pen = [[], [], [], [], [], [], []]
    grammar_rows: list[int] = []
    bitmask = torch.zeros(0)
    if any(c.request.matcher is not None for c in chunks):
        rows = sum(len(c.drafts) + 1 for c in chunks if c.request.matcher is not None)
        bitmask = torch.zeros(rows, (history.vocab_size + 31) // 32, dtype=torch.int32)
    width = max((len(w) for c in chunks for w in c.request.bad_words_ids), default=1) - 1  # longest prefix
    penalized = [c for c in chunks if c.request.params.penalized]
    if penalized:  # first: it gives each penalised request its history row
        out.catch_up = history.plan(penalized)
    for c in chunks:
        req, p = c.request, c.request.params
        stops = sorted({*p.stop_token_ids, *(() if p.ignore_eos else req.eos_ids)})
        multi = any(len(w) > 1 for w in req.bad_words_ids)
        if req.matcher is not None:
            with phase("grammar"):
                _grammar_masks(c, bitmask, len(grammar_rows))
            grammar_rows += range(c.first_row, c.first_row + len(c.drafts) + 1)
        for i in range(len(c.drafts) + 1):
            row = c.first_row + i
            if p.allowed_token_ids is not None:
                restricted[row] = True
                allowed[0] += [row] * len(p.allowed_token_ids)
                allowed[1] += p.allowed_token_ids
            if c.end + i - req.num_prompt < p.min_tokens:
                bans[0] += [row] * len(stops)
                bans[1] += stops
            for token, value in p.logit_bias:
                bias[0].append(row)
                bias[1].append(token)
                bias[2].append(value)
            if multi:
                values, inputs = _tail(c, i, width)
            for word in req.bad_words_ids:
                if len(word) == 1:
                    bans[0].append(row)
                    bans[1].append(word[0])
                else:
                    words.append((row, word, values, inputs))
            if p.penalized:
                pen[0].append(row)
                pen[1].append(history.row(req))
                pen[2].append(p.presence_penalty)
                pen[3].append(p.frequency_penalty)
                pen[4].append(p.repetition_penalty)
                index = len(pen[0]) - 1
                for draft in c.drafts[:i]:
                    pen[5].append(index)
                    pen[6].append(draft)
    if grammar_rows:
        out.grammar = (_ids(grammar_rows, device), bitmask.to(device))
    if allowed[0]:
        out.allowed = (_ids(allowed[0], device), _ids(allowed[1], device), _ids(restricted, device, torch.bool))
    if bans[0]:
        out.bans = (_ids(bans[0], device), _ids(bans[1], device))
    if bias[0]:
        out.bias = (_ids(bias[0], device), _ids(bias[1], device), _ids(bias[2], device, torch.float32))
    if words:
        prefix = [[ANY] * (width - len(w) + 1) + list(w[:-1]) for _, w, _, _ in words]
        out.words = (_ids([r for r, _, _, _ in words], device), _ids(prefix, device),
                     _ids([w[-1] for _, w, _, _ in words], device),
                     _ids([v for _, _, v, _ in words], device), _ids([x for _, _, _, x in words], device))
    if pen[0]:
        out.penalties = (*(_ids(x, device) for x in pen[:2]), *(_ids(x, device, torch.float32) for x in pen[2:5]),
                         _ids(pen[5], device), _ids(pen[6], device))
    return out


def _grammar_masks(c: ChunkRows, bitmask: torch.Tensor, first: int) -> None:
    """Rows `first …` of `bitmask`: chunk `c`'s rows' masks, row i's after drafts 0 … i-1. Rows after a
    draft the grammar refuses keep the mask before it: that draft is rejected, they are never reached."""
    m, taken = c.request.matcher, 0
    for i in range(len(c.drafts) + 1):
        if i == taken:
            m.fill(bitmask, first + i)
        else:
            bitmask[first + i] = bitmask[first + i - 1]
        if i < len(c.drafts) and i == taken:
            taken += m.accept([c.drafts[i]])
    m.rollback(taken)


def _tail(c: ChunkRows, i: int, width: int) -> tuple[list[int], list[int]]:
    """The `width` tokens before row i's sampled one: (values, input rows): a value where the host
    knows it (NOT_OUTPUT at prompt positions and before the start), an input row where it is pending."""
    req = c.request
    values, inputs = [], []
    for pos in range(c.end + i - width, c.end + i):
        if pos < req.num_prompt:
            values.append(NOT_OUTPUT)
            inputs.append(-1)
        elif pos in c.pending:
            values.append(NOT_OUTPUT)
            inputs.append(c.pending[pos])
        else:
            values.append(req.token_ids[pos] if pos < c.end else c.drafts[pos - c.end])
            inputs.append(-1)
    return values, inputs
