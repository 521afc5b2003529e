"""DeepSeek-V4.1 attention over a ragged batch: V4's sink attention (`SinkAttention`, without the
per-head query norm) with CSA2's shared compressed KV.

Every layer attends to its own window. A layer with a compress ratio also attends to the entries of
its KV source (the latest KV-source layer at or below it), those chosen by its index source (the
latest index-source layer at or below it):
- a KV source compresses (ratio 1: an entry per token; ratio 2: softmax-gated pairs, no overlap, no
  positional bias) and, when it is an index source too, derives the indexer keys from the same
  latent before RoPE: key = k_norm(wk(latent)), rotated at the entry's position;
- an index source scores the visible entries with its own queries and head weights, Σ_h w_h ·
  ReLU(q_h · k), and keeps the top `index_topk` (ties: the lowest entry); after the candidate source,
  only the candidate source's best blocks are eligible (`candidate_blocks`);
- the other layers reuse the latest index source's choice (`Selection`), passed down the stack.
Shapes: T tokens, E entries visible to the longest request, k = index_topk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rackserve.kernels import dispatch
from rackserve.kernels.indexer import top_entries
from rackserve.models.deepseek_v4.attention import Compressor, SinkAttention
from rackserve.models.deepseek_v4.batch import CompressPlan, ForwardBatch
from rackserve.models.deepseek_v4.layers import RMSNorm
from rackserve.models.deepseek_v4.rope import Rotary, apply_rope


@dataclass
class Selection:
    """An index source's choice for each token: rows `[T, k]` of its KV source's entries, and which are real."""

    rows: torch.Tensor
    valid: torch.Tensor


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """Which entries stay eligible after the candidate source: its `topk_blocks` best blocks of `block`
    consecutive entries, a block scoring its best visible entry, the block of the newest visible entry
    always kept; ties go to the lowest block.

    scores `[T, E]` fp32 (-inf where not visible); visible `[T, E]` bool -> eligible `[T, E]` bool.
    """
    t, e = scores.shape
    pad = -e % block
    best = F.pad(scores, (0, pad), value=float("-inf")).view(t, -1, block).amax(dim=-1)  # [T, B]
    newest = (visible.sum(dim=1) - 1).div(block, rounding_mode="floor")  # -1: nothing visible yet
    best = best.masked_fill(torch.arange(best.shape[1], device=scores.device) == newest[:, None], float("inf"))
    order = torch.sort(best, dim=-1, descending=True, stable=True).indices[:, :topk_blocks]
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, order, best.gather(1, order) > float("-inf"))
    return keep.repeat_interleave(block, dim=1)[:, :e] & visible


class Indexer(nn.Module):
    """An index source's scoring: its queries (`q_b_proj`, from the attention's query latent) and head
    weights (`weights_proj`); a KV source's also makes the keys (`wk`, `k_norm`)."""

    def __init__(self, config, owns_keys: bool):
        super().__init__()
        c = config
        self.heads, self.dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(c.hidden_size, self.heads, bias=False)
        self.wk = nn.Linear(c.head_dim, self.dim, bias=False) if owns_keys else None
        self.k_norm = RMSNorm(self.dim, c.rms_norm_eps) if owns_keys else None

    def write_keys(self, latent: torch.Tensor, plan: CompressPlan, keys, rotary: Rotary) -> None:
        """The keys of the entries completed this step, from their latent `[E_new, hd]` before RoPE."""
        k = self.k_norm(self.wk(latent))
        cos, sin = rotary.cos_sin(plan.entry_pos, k.dtype)
        keys.index_copy_(0, plan.entry_dst, apply_rope(k, cos, sin).to(keys.dtype))

    def queries(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
                rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """(q `[T, H, d]` rotated at `positions`, head weights `[T, H]` fp32 × H^-½; the kernels add d^-½)."""
        q = self.q_b_proj(q_residual).view(x.shape[0], self.heads, self.dim)
        cos, sin = rotary.cos_sin(positions, q.dtype)
        return apply_rope(q, cos, sin), self.weights_proj(x).float() * self.heads**-0.5


class Attention(SinkAttention):
    """Layer `layer` of a V4.1 model: its window, and per its role in `config` a compressor (KV source),
    an indexer (index source) and the candidate blocks (candidate source)."""

    def __init__(self, config, layer: int):
        super().__init__(config, layer, q_norm=False)
        c = config
        self.ratio = c.compress_ratios[layer]
        self.kv_source, self.index_source = c.kv_source(layer), c.index_source(layer)
        self.compressor = self.indexer = None
        if layer in c.kv_source_layer_ids:
            self.compressor = Compressor(c.hidden_size, c.head_dim, self.ratio, False, c.rms_norm_eps, biased=False)
        if layer in c.index_source_layer_ids:
            self.indexer = Indexer(c, owns_keys=layer in c.kv_source_layer_ids)
        self.candidates = layer == c.candidate_source_layer_id
        self.uses_candidates = c.uses_candidates(layer)
        self.candidate_topk_blocks, self.candidate_block_size = c.candidate_topk_blocks, c.candidate_block_size

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state, rotary: Rotary, selection: Selection | None,
                eligible: torch.Tensor | None, kv: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, Selection | None, torch.Tensor | None]:
        """x `[T, hidden]` -> (`[T, hidden]`, the selection and the eligible entries `[T, E]` (after the
        candidate source) for the layers above); reads and updates this layer's part of `state`. With
        `kv`, `write_kv` has written this step's state from every row of the batch `batch` was cut from
        (bounded replay: `batch` is its `Replay.first`), and `kv` are those rows' window rows."""
        if kv is None:
            q, kv, q_residual, cos, sin = self.project(x, batch.positions, rotary)
            self._compress(x, batch, state, rotary)
        else:
            q, q_residual, cos, sin = self.queries(x, batch.positions, rotary)
        if not self.ratio:
            return self.output(self.attend(q, kv, batch, state), cos, sin), selection, eligible
        plan = batch.plans[self.ratio]
        if self.indexer is not None:
            selection, eligible = self.select(x, q_residual, batch.positions, plan, state, rotary, eligible)
        out = self.attend(q, kv, batch, state, state.entry_rows(self.kv_source), selection.rows, selection.valid)
        return self.output(out, cos, sin), selection, eligible

    def write_kv(self, x: torch.Tensor, batch: ForwardBatch, state, rotary: Rotary) -> torch.Tensor:
        """What this step writes for every row of `batch` but its window (which `forward` writes once it read
        it): a KV source's entries and keys. x `[T, hidden]` -> the window rows `[T, hd]` for `forward(kv=…)`."""
        cos, sin = rotary.cos_sin(batch.positions, x.dtype)
        self._compress(x, batch, state, rotary)
        return self.window_rows(x, cos, sin)

    def _compress(self, x: torch.Tensor, batch: ForwardBatch, state, rotary: Rotary) -> None:
        """A KV source's new entries (and, an index source's, keys) into `state`."""
        if self.compressor is None:
            return
        plan = batch.plans[self.ratio]
        latent = self.compressor.update(x, plan, state.ring[self.layer], state.entry_rows(self.layer), rotary)
        if latent is not None and self.indexer is not None:
            self.indexer.write_keys(latent, plan, state.index_key_rows(self.layer), rotary)

    def select(self, x, q_residual, positions, plan: CompressPlan, state, rotary: Rotary,
               eligible: torch.Tensor | None) -> tuple[Selection, torch.Tensor | None]:
        """This index source's top-k over the entries its tokens may see (and, after the candidate source,
        are eligible), and for the candidate source the eligible entries it leaves to later layers."""
        q, head_w = self.indexer.queries(x, q_residual, positions, rotary)
        keys = state.index_key_rows(self.kv_source)
        visible = plan.visible & eligible if self.uses_candidates else plan.visible
        if self.candidates:
            scores = dispatch.indexer_scores(q, keys, plan.visible_row, visible, head_w)
            chosen, valid = top_entries(scores, self.indexer.topk)
            eligible = candidate_blocks(scores, visible, self.candidate_topk_blocks, self.candidate_block_size)
        else:
            chosen, valid = dispatch.indexer_topk(q, keys, plan.visible_row, visible, head_w, self.indexer.topk)
        return Selection(plan.visible_row.gather(1, chosen), valid), eligible
