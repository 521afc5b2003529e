"""Weight and state bytes of a DeepSeek model (V4 or V4.1) per GPU, on the meta device: weights in bf16,
FP8 and FP8+FP4 as published; request state for each `EngineConfig.state_dtype`, and the decode batch
that fits.

Every figure comes from the model's own module tensors (its family's `model_class`, built on the meta
device: nothing is allocated), quantized by the same function that writes published checkpoints (the
class's `published_format`, `kernels.block_scaled.quantize`) in the blocks its generation publishes
(`PUBLISHED_BLOCK`), so it is what `load_model` would hold. A rank of a DEP instance holds the dense
part (attention, routers, shared experts, embedding, head, MTP's dense part) and its routed expert slots:
(experts + redundant slots) / ranks of each MoE layer, MTP layers included. State figures are the
runtime's own state (`rackserve.models.new_state`) on the meta device (bf16 activations).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from rackserve.config import STATE_DTYPES, EngineConfig
from rackserve.kernels.block_scaled import quantize
from rackserve.models import family, new_state
from rackserve.models.deepseek_v4.config import QuantConfig
from rackserve.models.deepseek_v4.loader import build_model
from rackserve.models.deepseek_v4.published import PUBLISHED_EXPERTS

GIB = 1 << 30
WORKSPACE_BYTES = 16e9  # assumed: activations, communication buffers, CUDA graphs per GPU
LONG_CONTEXT = 131072  # tokens of the long-context figure (V4-Flash serves up to 1M)
PUBLISHED_STATE_BYTES_PER_TOKEN = 890  # DeepSeek's V4.1-Flash figure (cross-layer KV sharing plus FP4)
PRECISION_NAMES = ("bf16", "FP8", "FP8+FP4")


def precisions(config) -> dict[str, QuantConfig | None]:
    """What a user picks between: the checkpoint dequantized, FP8 throughout, and DeepSeek's release, in
    the scale blocks `config`'s generation publishes."""
    block = family(config.model_type).model_class.PUBLISHED_BLOCK
    return dict(zip(PRECISION_NAMES, (None, QuantConfig(weight_block_size=block, scale_fmt="ue8m0", expert_dtype="fp8"),
                                      QuantConfig(weight_block_size=block, scale_fmt="ue8m0", expert_dtype="fp4"))))


@dataclass(frozen=True)
class WeightBytes:
    """dense: bytes every DP rank holds; expert_slot: bytes of one routed-expert slot of every MoE layer
    (main and draft), i.e. one expert of each; experts: the number of routed experts per main layer;
    all_experts: bytes of every routed expert once (a draft model's layers may have fewer)."""

    dense: int
    expert_slot: int
    experts: int
    all_experts: int

    def rank(self, slots: int) -> int:
        """Bytes of a rank holding the dense part and `slots` expert slots of every MoE layer."""
        return self.dense + slots * self.expert_slot

    @property
    def full_copy(self) -> int:
        return self.dense + self.all_experts


@functools.cache  # the meta build of V4-Flash's shape takes seconds; a report asks for each precision once
def weight_bytes(config, quant: QuantConfig | None, dtype: torch.dtype = torch.bfloat16) -> WeightBytes:
    """The bytes of `config`'s weights stored as `quant` says (None: all in `dtype`), fp32 where the
    model keeps it. Tables a family keeps in host memory are not weights (`host_table_bytes`)."""
    model = build_model(config, dtype, materialize=False, cls=family(config.model_type).model_class)
    dense = slot = experts = 0
    for name, tensor in model.state_dict().items():
        fmt = model.published_format(name, quant)
        parts = [tensor] if fmt is None else quantize(tensor, quant.weight_block_size, fp4=fmt == "fp4",
                                                      ue8m0=quant.scale_fmt == "ue8m0")
        size = sum(t.numel() * t.element_size() for t in parts)
        if PUBLISHED_EXPERTS.search(name):
            # one expert of this layer: every layer has as many slots, a draft model's with fewer experts too
            slot += size // len(tensor)
            experts += size
        else:
            dense += size
    return WeightBytes(dense, slot, config.n_routed_experts, experts)


def slots_per_rank(experts: int, redundant: int, ranks: int) -> int:
    """Expert slots each rank of an instance holds (the busiest one when they do not divide evenly)."""
    return -(-(experts + redundant) // ranks)


def serving_report(model, ranks: dict[str, int]) -> dict[str, dict[str, float]]:
    """{row: {precision: GiB}} for ranks {label: expert slots it holds}, then the dense part, one slot
    and one full copy of the model."""
    per = {name: weight_bytes(model, quant) for name, quant in precisions(model).items()}
    rows = {label: {p: w.rank(slots) / GIB for p, w in per.items()} for label, slots in ranks.items()}
    rows["dense (every DP rank)"] = {p: w.dense / GIB for p, w in per.items()}
    rows["one routed-expert slot"] = {p: w.expert_slot / GIB for p, w in per.items()}
    rows["one full copy (all experts once)"] = {p: w.full_copy / GIB for p, w in per.items()}
    return rows


@dataclass(frozen=True)
class StateBytes:
    """slot: a request's fixed state (windows, carries); page: the state of `block_size` tokens
    (compressed entries and indexer keys)."""

    slot: int
    page: int
    block_size: int

    @property
    def per_token(self) -> float:
        return self.page / self.block_size

    def request(self, tokens: int) -> int:
        """Bytes of a request holding `tokens` tokens (whole pages)."""
        return self.slot + -(-tokens // self.block_size) * self.page


def state_bytes(config, state_dtype: str, dtype: torch.dtype = torch.bfloat16) -> StateBytes:
    """What the runtime's state takes per request for `config` held as `state_dtype`, in pages of the
    engine's default block size."""
    block = EngineConfig().resolve(config).block_size
    probe = new_state(config, 1, 1, block, dtype, "meta", state_dtype=state_dtype)
    return StateBytes(probe.slot_bytes, probe.page_bytes, block)


def state_report(model, rank_weights: int, hbm: dict[str, float],
                 context: int = LONG_CONTEXT) -> dict[str, dict[str, float]]:
    """{state_dtype: figures}: bytes per token, fixed MiB per request, GiB of a `context`-token request,
    and for each GPU of `hbm` (name: bytes) the most such requests a rank fits beside `rank_weights`
    bytes of weights and the workspace, each with its row of the penalties' token counts
    (`TokenHistory`, part of the engine's state budget)."""
    from rackserve.engine.penalties import TokenHistory  # here: a model module imports no engine at load

    counts = TokenHistory.bytes_for(1, model.vocab_size)
    rows = {}
    for state_dtype in STATE_DTYPES:
        s = state_bytes(model, state_dtype)
        row = {"bytes/token": s.per_token, "fixed MiB/request": s.slot / 2**20, "counts MiB/request": counts / 2**20,
               f"GiB/request at {context // 1024}K": s.request(context) / GIB}
        for gpu, nbytes in hbm.items():
            row[f"batch on {gpu}"] = max(0, int((nbytes - rank_weights - WORKSPACE_BYTES)
                                                // (s.request(context) + counts)))
        rows[state_dtype] = row
    return rows


def format_state_report(rows: dict[str, dict[str, float]]) -> str:
    columns = list(next(iter(rows.values())))
    widths = [max(len(c), 10) + 2 for c in columns]
    lines = ["state_dtype" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths))]
    for name, row in rows.items():
        cells = [f"{v:>{w}.0f}" if k.startswith("batch") else f"{v:>{w}.2f}" for (k, v), w in zip(row.items(), widths)]
        lines.append(f"{name:<11}" + "".join(cells))
    return "\n".join(lines)


def format_report(rows: dict[str, dict[str, float]]) -> str:
    width = max(map(len, rows)) + 2
    lines = [" " * width + "".join(f"{p:>10}" for p in PRECISION_NAMES)]
    lines += [f"{label:<{width}}" + "".join(f"{v:10.2f}" for v in row.values()) for label, row in rows.items()]
    return "\n".join(lines)
