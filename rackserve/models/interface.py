"""What the engine needs of a model family, and nothing more: its config (`ModelSpec`), its
per-request state (`rackserve.models.state.PagedState`), the model (`ServingModel`) and, for
speculative decoding, its draft model (`Drafter`). The engine, the state cache, the speculator and
EPLB see a family only through these; a family lives in its own package under `rackserve.models`
and registers itself by `model_type` (`rackserve.models.register`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from rackserve.models.checkpoint import StoredTensor
from rackserve.models.moe import RoutedMoE
from rackserve.models.reply import ReplyFormat
from rackserve.models.state import PagedState, RequestState

# a request's handle into the state and the token ids it runs in this forward
BatchRequest = tuple[RequestState, Sequence[int]]


class ModelSpec(Protocol):
    """A family's configuration (read from the checkpoint's config.json), as the engine uses it."""

    model_type: str
    vocab_size: int
    max_position_embeddings: int
    num_hidden_layers: int
    n_routed_experts: int  # routed experts per MoE layer
    num_nextn_predict_layers: int  # draft (MTP) layers the checkpoint has; 0 for none
    eos_token_ids: tuple[int, ...]
    dtype: str  # the checkpoint's compute dtype ("bfloat16", …)

    @property
    def host_table_bytes(self) -> int:
        """Bytes of the tables the family keeps in host memory, one copy per node (V4.1's Engram); 0 for none."""

    @property
    def replay_window(self) -> int:
        """Tokens bounded replay recomputes after a prefix hit and keeps past the last KV source in a
        prefill (DeepSeek-V4.1's sliding window); 0 for a family without it."""

    @property
    def min_block_size(self) -> int:
        """The smallest block of tokens a page may hold (block sizes are multiples of it)."""

    @property
    def block_rule(self) -> str:
        """Why blocks come in multiples of `min_block_size` (for error messages)."""

    @property
    def num_moe_layers(self) -> int:
        """MoE layers with routed experts, main then draft: rows of an expert layout (`phy2log`)."""

    @property
    def expert_counts(self) -> tuple[int, ...]:
        """Routed experts of each of the `num_moe_layers` layers (a draft model's may have fewer)."""

    @property
    def draft_confidence_head(self) -> bool:
        """Whether the draft model estimates its drafts' acceptance (`EngineConfig.draft_confidence`)."""

    def check_speculation(self, k: int) -> None:
        """Raise `ConfigError` naming the fix if this model cannot draft `k` tokens per step."""


@dataclass(frozen=True)
class StaticShape:
    """The fixed shape of a padded batch (`ServingModel.build_batch(static=…)`), which a compiled or
    captured forward is specialised to: `tokens` token rows (real ones first, then padding) and page
    tables `pages` wide."""

    tokens: int
    pages: int


class Rollback(Protocol):
    """Gives back the state rows a forward's speculative tokens wrote (see `ServingModel.rollback`)."""

    def undo(self, rejected: torch.Tensor) -> None:
        """rejected: bool `[T]` over the forward's token rows."""


class ServingModel(Protocol):
    """One forward over a ragged batch of many requests, each with its own state.

    `build_batch(state, requests, num_logits)` turns (request handle, new token ids) pairs into the
    family's batch (index arithmetic shared by all layers); calling the model runs it, writing the new
    tokens' state and returning logits `[sum(num_logits), vocab]` (fp32) for each request's last
    `num_logits[i]` tokens (default 1), and with `with_streams` the final hidden states `[T, …]` a
    drafter reads. The caller advances each request's `num_tokens` once a step is accepted.
    """

    config: ModelSpec

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def moe_layers(self) -> list[RoutedMoE]:
        """The main model's MoE layers, in order (what EPLB balances)."""

    @property
    def draft_moe_layers(self) -> list[RoutedMoE]:
        """The MoE layers a draft forward runs, in order (balanced on their own); empty without a draft model."""

    @property
    def follow_moe_layers(self) -> list[RoutedMoE]:
        """The MoE layers the drafter's follow of a main forward runs (V4's MTP layer; none for DSpark)."""

    def build_batch(self, state: PagedState, requests: Sequence[BatchRequest],
                    num_logits: Sequence[int] | None = None, static: StaticShape | None = None,
                    scratch: RequestState | None = None) -> Any:
        """With `static`, every tensor of the batch has a shape that depends on `static` alone: the
        requests are padded with one-token requests on `scratch` (a request at 0 tokens that holds a
        page and never advances) to `static.tokens` token rows, and the logits rows to as many;
        rows past the real ones are padding. A family without `static_forward` need not take
        `static` and `scratch` (the engine then refuses `compile`)."""

    def __call__(self, batch: Any, state: PagedState,
                 with_streams: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def static_forward(self, batch: Any, state: PagedState) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of a batch built with `static`, as `torch.compile` and CUDA graph capture take
        it: (logits, streams), no host synchronisation, no shape that depends on the data, and no
        inference mode (which the compiler cannot trace; run it with grad off)."""

    def rollback(self, state: PagedState, batch: Any, speculative: torch.Tensor) -> Rollback:
        """Save, before `batch` runs, the main layers' state rows its `speculative` tokens (bool `[T]`)
        will write, so that rejected ones can be undone."""

    def drafter(self, state: PagedState) -> Drafter:
        """The draft model over `state` (built with `draft_layers=1`); raises if there is none."""

    def shard_experts(self, ep, phy2log: torch.Tensor) -> None:
        """Expert parallel: keep only this rank's expert slots; phy2log `[num_moe_layers, num_slots]`."""


class Drafter(Protocol):
    """A draft model whose state follows the main model's (see `rackserve.engine.speculative`).

    `graphs`: None, or the engine's fixed-shape runner (`rackserve.engine.graphs.DecodeGraphs`: `shape_for`,
    `run`, `scratch`) when `EngineConfig.compile` is on; the drafter then runs its forwards through it."""

    graphs: Any

    def forwards(self, k: int) -> int:
        """Draft forwards (each running `draft_moe_layers`) that proposing k drafts takes."""

    def follow(self, batch: Any, requests: Sequence[BatchRequest], streams: torch.Tensor,
               speculative: torch.Tensor) -> Rollback | None:
        """Follow the main forward `batch` (over `requests`, as its batch had them) in the draft model's
        state; streams: what the main forward returned with them; speculative: bool `[T]`, its drafts.
        Returns what undoes the drafts' rows (None when nothing ran)."""

    def keep(self, slots: torch.Tensor, streams: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep, for the requests in `slots` `[R]`, the main streams of rows `rows` `[R]` (their last kept
        token), which the draft layer pairs with the next token."""

    def propose(self, handles: Sequence[RequestState], last: Sequence[int], k: int) -> list[list[int]]:
        """k greedy drafts after each request's last token `last[i]` (handles advanced past it); the
        draft layer's state is left as it was."""

    def dummy_forward(self, scratch: RequestState) -> None:
        """One draft forward on a scratch request that never advances (keeps a DP rank's MoE exchanges in
        step with its peers')."""

    def stats(self) -> dict:
        """The drafter's own figures for `llm.engine.stats()` (DSpark: its confidence per position)."""


@dataclass(frozen=True)
class ModelFamily:
    """A model family as the registry knows it: its `model_type`, how to read its config.json
    (a dict -> `ModelSpec`), how to load a checkpoint (`load(path, dtype=…, device=…, weights=…,
    shard=…) -> ServingModel`), its state memory (`new_state(config, num_slots, num_pages, block_size,
    dtype, device, draft_layers, state_dtype) -> PagedState`, see `rackserve.models.new_state`), its
    model class (`model_class(config)`, what memory estimates build on the meta device), for a family
    whose checkpoints ship no jinja chat template its own chat encoding (`chat(messages, tools=…,
    thinking=…, reasoning_effort=…, response_format=…) -> prompt text`, BOS included), how its
    replies mark reasoning and tool calls (`reply`, for reply parsing), and for a family with tables
    read from host memory (V4.1's Engram) which tensors those are (`host_tables(path) ->
    list[StoredTensor]`; `load` then takes them as `host_tensors`, the node's shared copy)."""

    model_type: str
    config_from_dict: Callable[[dict], ModelSpec]
    load: Callable[..., ServingModel]
    new_state: Callable[..., PagedState]
    model_class: type | None = None
    chat: Callable[..., str] | None = None
    reply: ReplyFormat | None = None
    host_tables: Callable[[Path], list[StoredTensor]] | None = None
