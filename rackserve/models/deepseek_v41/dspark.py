"""DeepSeek-V4.1's draft model, DSpark: a block of tokens drafted in one pass, then sampled in order.

The checkpoint's `mtp.0 … mtp.{S-1}` are S stages, each a V4.1 block (delayed mHC, a MoE of its own
`dspark_n_routed_experts`, no Engram) whose attention is `DSparkAttention`:
- **Context.** The main model's streams entering the `dspark_target_layer_ids` layers (mean over the
  hc copies, concatenated: `[T, D · len(targets)]`) go through stage 0's `main_proj` and `main_norm`
  into main_x `[T, D]`. Each stage keeps, in its window ring (one more layer of the state), its own
  kv_norm(wkv(main_x)) of the request's last `sliding_window` positions, rotated at their positions.
  A position's row is a function of the tokens up to it, so the rings follow the main layers exactly
  (`DSparkDrafter.follow` writes them from every main forward; rejected drafts are rolled back with them).
- **Draft pass.** After n tokens and the sampled next token t, the block [t, noise × (B − 1)] at positions
  n … n+B−1 runs through the stages; every block row attends to its stage's context rows (positions
  n−W … n−1) and to all B block rows (non-causal), with the sink. Nothing is written.
- **Head.** The last stage's streams collapse with its pre-mix -> h `[B, D]` -> `norm` -> the main model's
  `lm_head`. Then in order, d_0 = t: logits_i += markov_head.head(markov_head.embed(d_i)) (a rank-r bigram
  bias from the token before), d_{i+1} = argmax. The confidence head's sigmoid(proj([h_i, embed(d_i)]))
  estimates the chance that d_{i+1} is accepted.

As DeepSeek's reference (`DSparkBlock`, `DSparkAttention`, `Transformer.forward_spec`) and vLLM's
(`deepseek_v41/nvidia/dspark.py`) define it; the block is the checkpoint's `dspark_block_size` rows as
DeepSeek's reference runs it (vLLM runs as many rows as it drafts), the first k drafts are proposed.
Drafts are greedy, a one-hot draft distribution, so verification's rejection sampling stays exact for
sampled requests (`rackserve.engine.sampling`). The confidences are reported (`DSparkDrafter.stats`)
and, with `EngineConfig.draft_confidence` (`DSparkDrafter.min_confidence`), choose how many drafts to
verify: a request's drafts are cut where the product of their confidences (the estimate that all of them
so far are accepted) falls below it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from rackserve.kernels import dispatch
from rackserve.models.causal_lm import Embedding
from rackserve.models.deepseek_v4.attention import SinkAttention
from rackserve.models.deepseek_v4.batch import ForwardBatch, RingGather
from rackserve.models.deepseek_v4.layers import RMSNorm
from rackserve.models.deepseek_v4.rollback import Rollback
from rackserve.models.deepseek_v4.rope import Rotary
from rackserve.models.deepseek_v41.decoder import Block
from rackserve.models.state import RequestState
from rackserve.timing import phase


class DSparkAttention(SinkAttention):
    """A stage's attention: block rows over the stage's context rows and each other (see the module)."""

    def __init__(self, config, layer: int):
        super().__init__(config, layer, q_norm=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state, rotary: Rotary, selection, eligible, kv=None):
        """x `[R · B, hidden]` (the block rows); `batch.swa` gives each row its keys: rows of this stage's
        window ring (the context) and of the block's own K=V -> (`[R · B, hidden]`, selection, eligible)."""
        q, block, _, cos, sin = self.project(x, batch.positions, rotary)
        ring = state.swa[self.layer]
        out = dispatch.sink_attention(q, [ring.flatten(0, 1), block], batch.swa.rows, batch.swa.valid, self.sinks,
                                      self.head_dim**-0.5)
        return self.output(out, cos, sin), selection, eligible


class MarkovHead(nn.Module):
    """The rank-r bigram bias: token -> `embed` `[r]` -> `head` -> `[vocab]`."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.embed = Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """[h, markov embedding] `[…, D + r]` -> the logit of acceptance `[…]` (fp32, as DeepSeek computes it)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.float()).squeeze(-1)


class Stage(Block):
    """DSpark stage `stage` of `config` (state layer `num_hidden_layers + stage`): a V4.1 block with
    `DSparkAttention` and the draft experts; stage 0 also projects the context, the last has the heads."""

    attention_cls = DSparkAttention

    def __init__(self, config, stage: int):
        experts, per_token = config.draft_experts
        super().__init__(replace(config, n_routed_experts=experts, num_experts_per_tok=per_token),
                         config.num_hidden_layers + stage)
        c, d = config, config.hidden_size
        if stage == 0:
            self.main_proj = nn.Linear(d * len(c.dspark_target_layer_ids), d, bias=False)
            self.main_norm = RMSNorm(d, c.rms_norm_eps)
        if stage == c.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(d, c.rms_norm_eps)
            self.markov_head = MarkovHead(c.vocab_size, c.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(d + c.dspark_markov_rank)


class DSparkDrafter:
    """Drafts with `model`'s DSpark stages (`model.mtp`), whose context rings are the state's layers after
    the main ones (`Drafter`, `rackserve.models.interface`). A draft pass is one forward of the stages
    whatever k is; the follow runs no MoE. `graphs` is not used: the passes run eagerly. `min_confidence`:
    see the module (0: propose all k)."""

    def __init__(self, model, state):
        self.model, self.state = model, state
        c = model.config
        self.layers = range(c.num_hidden_layers, c.num_hidden_layers + c.num_nextn_predict_layers)
        self.graphs = None
        self.min_confidence = 0.0
        self.confidence: list[float] = []  # per draft position: the confidences' sum (sigmoid)
        self.drafts: list[int] = []  # per draft position: drafts proposed

    def forwards(self, k: int) -> int:
        """Draft forwards (each with the stages' MoE exchanges) that proposing k drafts takes: one."""
        return 1

    def follow(self, batch: ForwardBatch, requests, streams: torch.Tensor, speculative: torch.Tensor) -> Rollback:
        """Write the context rows of the positions the main forward `batch` wrote into its window rings
        (each request's last `sliding_window`, `batch.swa_write`) from `streams`, the DSpark input `[T, D · n]`
        the forward returned. Returns what gives back the rows its `speculative` tokens (bool `[T]`) wrote."""
        undo = Rollback(self.state, batch, speculative, self.layers, lookback=False)
        write = batch.swa_write
        with phase("drafting"):
            self.model.dspark_context(streams.index_select(0, write.src), batch.positions.index_select(0, write.src),
                                      write.dst, self.state)
        return undo

    def keep(self, slots: torch.Tensor, streams: torch.Tensor, rows: torch.Tensor) -> None:
        """Nothing to keep: a draft pass reads only the context rings and the last token."""

    def propose(self, handles: Sequence[RequestState], last: Sequence[int], k: int) -> list[list[int]]:
        """The first k of the block's greedy drafts for each request of `handles` after its sampled token
        `last[i]` (not yet run by the main model), fewer where their confidence falls below
        `min_confidence`; the state is left as it was."""
        drafts, confidence = self._draft(list(handles), list(last))
        # the host reads each once; what follows is a few numbers a request
        drafts, confidence = drafts[:, :k].tolist(), torch.sigmoid(confidence[:, :k]).cpu()
        keep = (torch.cumprod(confidence, dim=1) >= self.min_confidence).sum(1).tolist()  # a prefix: products fall
        if len(self.confidence) < k:
            self.confidence += [0.0] * (k - len(self.confidence))
            self.drafts += [0] * (k - len(self.drafts))
        for i, total in enumerate(confidence.sum(0).tolist()):
            self.confidence[i] += total
            self.drafts[i] += len(handles)
        return [row[:n] for row, n in zip(drafts, keep)]

    def _draft(self, handles: list[RequestState], last: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass -> (drafts `[R, B]`, confidence logits `[R, B]` fp32)."""
        c, state = self.model.config, self.state
        b, w, r = c.dspark_block_size, state.window, len(handles)
        device = state.device
        starts = torch.tensor([h.num_tokens for h in handles], dtype=torch.long)
        slots = torch.tensor([h.slot for h in handles], dtype=torch.long)
        positions = (starts[:, None] + torch.arange(b)).flatten()  # [R · B]
        # keys: the context rows of positions n-W … n-1 (ring rows; none before 0), then the block's rows
        context = starts[:, None] - w + torch.arange(w)  # [R, W]
        ring_rows = slots[:, None] * w + context.clamp(min=0) % w
        block_rows = state.num_slots * w + torch.arange(r * b).view(r, b)
        rows = torch.cat([ring_rows, block_rows], dim=1).repeat_interleave(b, dim=0)
        valid = torch.cat([context >= 0, torch.ones(r, b, dtype=torch.bool)], dim=1).repeat_interleave(b, dim=0)
        ids = torch.full((r, b), c.dspark_noise_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor(last, dtype=torch.long)
        batch = ForwardBatch(ids.flatten(), positions, torch.arange(r * b), RingGather(rows, valid), None, {})
        with phase("drafting"):
            return self.model.dspark_draft(batch.to(device), state)

    def dummy_forward(self, scratch: RequestState) -> None:
        """One draft pass on the scratch request `scratch`, which never advances: keeps a DP rank's MoE
        exchanges in step with peers that draft."""
        self._draft([scratch], [0])

    def stats(self) -> dict:
        """The confidence head's mean estimate of acceptance, per draft position."""
        return {"spec_confidence": [s / n if n else 0.0 for s, n in zip(self.confidence, self.drafts)]}
