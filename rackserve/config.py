"""Engine-level configuration: frozen, validated `EngineConfig`, and the `ConfigError` every invalid
value fails with (naming the field, the value and what is allowed). A model family's own config
(e.g. `rackserve.models.deepseek_v4.config.ModelConfig`) lives in its package.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rackserve.models.interface import ModelSpec

DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """An invalid or unsupported configuration value; the message names the field and the fix."""


MAX_SPECULATIVE_TOKENS = 3
WEIGHTS = ("stored", "dequantize")
# how compressed entries / indexer keys are held: the model dtype, FP8 / FP8, FP8 / FP4, FP4 / FP4 with
# one-byte scales (DeepSeek-V4.1's format) (models.deepseek_v4.state)
STATE_DTYPES = ("auto", "fp8", "fp8-fp4", "fp4")
COMPILE = ("off", "on", "trace")


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine (one DP rank). Model-dependent defaults are resolved by `resolve`.

    max_num_seqs: requests running at once (each holds one state slot).
    max_num_batched_tokens: token budget of one step (decode tokens + prefill chunks).
    max_model_len: prompt + output tokens of one request; default min(max_position_embeddings, 8192).
    block_size: tokens per state page and prefix-cache block; a multiple of every compress rate
      (default: their least common multiple, at least 16).
    state_memory_mb: bytes budget of the state cache (slots, pages and prefix-cache snapshots) and of
      the penalties' token counts (5 bytes per vocabulary entry per running request), MiB.
    prefix_caching: keep full blocks of finished requests to skip their prefill next time.
    prefix_snapshots: how many block-boundary snapshots of window/carry state the prefix cache may
      keep (default max_num_seqs); each costs one slot of memory.
    eplb_interval: in an expert-parallel gang, re-place the experts every this many steps (0: never).
    eplb_min_gain: keep the current expert layout unless the new one is this much more balanced.
    max_new_kv_loads_per_step: a decode rank admits at most this many requests whose state was pushed
      to it per step, so a burst of arrivals cannot stall the requests already decoding.
    kv_pool_mb: the NIXL-registered memory a rank moves request state through (MiB), when it has a
      KV agent (disaggregated prefill/decode).
    kv_timeout_s: a reservation for pushed state expires after this long; the decode rank then
      prefills the request itself.
    speculative_tokens: tokens the model's draft model (DeepSeek-V4's MTP layer, V4.1's DSpark) drafts per
      request and decode step, verified in one forward of the main model (0: no speculation; at most 3).
    draft_confidence: verify a request's drafts only as long as the draft model's estimate that all of them
      so far are accepted stays at or above this (DSpark's confidence head); 0 verifies all of them.
    weights: "stored" keeps a quantized checkpoint's FP8/FP4 weights as stored (computed by block-scaled
      kernels); "dequantize" turns them into `dtype` at load, for machines without FP8 kernels.
    state_dtype: how compressed entries and indexer keys are held: "auto" (the model dtype), "fp8"
      (both FP8 e4m3, block-scaled), "fp8-fp4" (entries FP8, indexer keys FP4 e2m1) or "fp4"
      (DeepSeek-V4.1's format: entries FP4 with an E4M3 scale per 16 values, indexer keys FP4 with a
      UE8M0 scale per 32); windows and compressor carries stay in the model dtype (see
      `rackserve.models.deepseek_v4.state`). Prefill and decode ranks that move state between them must agree.
    compile: the decode forward on fixed shapes (`rackserve.engine.graphs`): "off" (eager), "on"
      (CUDA graphs on CUDA, torch.compile elsewhere, compiled once per shape and cached on disk) or
      "trace" (traced as one graph and run without code generation: checks capture safety quickly).
    graph_buckets: the token counts a decode pass is padded to when `compile` is on; a pass with more
      tokens than the largest runs eager.
    async_scheduling: schedule step N+1 and build its inputs, and process step N's outputs, while
      step N's forward runs (on a forward thread); the tokens sampled at N reach N+1 on the device.
      Outputs are the same as without it. Not with speculative decoding yet (a step verifies the
      drafts the host took from the step before).
    table_dir: where a node keeps its one copy of the model's host tables (DeepSeek-V4.1's Engram: FP8
      codes and scales, 189 GiB for V4.1-Flash) that every rank of the node maps, in a multi-rank
      deployment (`rackserve.actors.table_host`): a node-local memory file system (tmpfs, e.g. /dev/shm,
      or hugetlbfs), as large as the tables. A single-process `LLM` maps them from the checkpoint's files.
    bounded_replay: DeepSeek-V4.1's bounded decoder replay, as DeepSeek and vLLM serve it (the default
      for a family that has it; `true` elsewhere is refused): in a prefill, the last KV-source layer
      writes its window, entries and keys for every token, then it and the layers above run on each
      request's last `sliding_window` tokens only; a prefix hit needs no window snapshot: it recomputes
      its last min(window, hit) tokens, reading the cached entries. An approximation (the kept tokens'
      windows in those layers, and the recomputed tokens', start where computing started; measured
      in `rackserve.bench.bounded_replay`); `false` runs every layer on every token, exactly.
    table_huge_pages: ask for 2 MB pages for the tables (`MADV_HUGEPAGE`): fewer TLB misses on their
      random row reads, where the file system grants them (hugetlbfs, or tmpfs with `huge=` or
      `transparent_hugepage/shmem_enabled` set to `advise`); elsewhere 4 KB pages, as without it.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    block_size: int | None = None
    state_memory_mb: float = 256.0
    prefix_caching: bool = True
    prefix_snapshots: int | None = None
    dtype: str | None = None
    device: str = "cpu"
    seed: int = 0
    eplb_interval: int = 0
    eplb_min_gain: float = 0.0
    max_new_kv_loads_per_step: int = 4
    kv_pool_mb: float = 64.0
    kv_timeout_s: float = 10.0
    speculative_tokens: int = 0
    draft_confidence: float = 0.0
    weights: str = "stored"
    state_dtype: str = "auto"
    compile: str = "off"
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    async_scheduling: bool = False
    table_dir: str = "/dev/shm"
    table_huge_pages: bool = False
    bounded_replay: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.eplb_interval, int) or self.eplb_interval < 0:
            raise ConfigError(f"eplb_interval={self.eplb_interval!r} must be an integer ≥ 0 (0 turns EPLB off)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_new_kv_loads_per_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.max_num_batched_tokens <= self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must exceed max_num_seqs="
                f"{self.max_num_seqs}, or a full decode batch would leave no budget for prefill"
            )
        for name in ("max_model_len", "block_size", "prefix_snapshots"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < (0 if name == "prefix_snapshots" else 1)):
                raise ConfigError(f"{name}={value!r} must be a positive integer (or omitted for the default)")
        for name in ("state_memory_mb", "kv_pool_mb", "kv_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; use one of {DTYPES}")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"weights={self.weights!r} must be one of {WEIGHTS}")
        if self.state_dtype not in STATE_DTYPES:
            raise ConfigError(f"state_dtype={self.state_dtype!r} must be one of {STATE_DTYPES}")
        if self.compile not in COMPILE:
            raise ConfigError(f"compile={self.compile!r} must be one of {COMPILE}")
        buckets = self.graph_buckets
        if (not isinstance(buckets, (list, tuple)) or not buckets
                or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in buckets)):
            raise ConfigError(f"graph_buckets={buckets!r} must be a list of positive token counts, e.g. [1, 8, 32]")
        object.__setattr__(self, "graph_buckets", tuple(sorted(set(buckets))))  # YAML gives lists
        k = self.speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"speculative_tokens={k!r} must be an integer from 0 (off) to {MAX_SPECULATIVE_TOKENS}")
        c = self.draft_confidence
        if not isinstance(c, (int, float)) or isinstance(c, bool) or not 0 <= c < 1:
            raise ConfigError(f"draft_confidence={c!r} must be a number in [0, 1) (0: verify every draft)")
        if c and not k:
            raise ConfigError(f"draft_confidence={c} chooses among drafts: set speculative_tokens too, or leave it 0")
        for name in ("async_scheduling", "table_huge_pages"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true or false")
        if not (self.bounded_replay is None or isinstance(self.bounded_replay, bool)):
            raise ConfigError(f"bounded_replay={self.bounded_replay!r} must be true, false, or omitted for the model's "
                              "default")
        if not isinstance(self.table_dir, str) or not self.table_dir.startswith("/"):
            raise ConfigError(f"table_dir={self.table_dir!r} must be an absolute path (a memory file system such "
                              "as /dev/shm)")
        if self.async_scheduling and k:
            raise ConfigError("async_scheduling does not run with speculative decoding yet (each step verifies the "
                              "drafts the step before proposed on the host); set speculative_tokens: 0 or "
                              "async_scheduling: false")

    def resolve(self, model: ModelSpec) -> "EngineConfig":
        """Fill the model-dependent defaults and check them against `model` (a family's config)."""
        block = self.block_size or model.min_block_size * max(1, -(-16 // model.min_block_size))
        if block % model.min_block_size:
            raise ConfigError(f"block_size={block} must be a multiple of {model.min_block_size}, {model.block_rule}")
        max_len = self.max_model_len or min(model.max_position_embeddings, 8192)
        if max_len > model.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                f"{model.max_position_embeddings}"
            )
        if self.speculative_tokens:
            model.check_speculation(self.speculative_tokens)
        if self.draft_confidence and not model.draft_confidence_head:
            raise ConfigError(f"draft_confidence={self.draft_confidence}: the {model.model_type} model's draft model "
                              "has no confidence head (DeepSeek-V4.1's DSpark has one); set draft_confidence: 0")
        if self.bounded_replay and not model.replay_window:
            raise ConfigError(f"bounded_replay: the {model.model_type} model has no bounded replay (DeepSeek-V4.1's); "
                              "set bounded_replay: false or leave it out")
        return replace(self, block_size=block, max_model_len=max_len, dtype=self.dtype or model.dtype,
                       bounded_replay=bool(model.replay_window) if self.bounded_replay is None else self.bounded_replay,
                       prefix_snapshots=self.max_num_seqs if self.prefix_snapshots is None else self.prefix_snapshots)
