"""Load a DeepSeek-V4.1 checkpoint as published: DeepSeek's tensor names (`checkpoint_names.V41_NAMES`),
FP8 linears with UE8M0 32×32 block scales, FP4 routed experts, bf16/fp32 compressors, sharded files.

Read as V4's are (`rackserve.models.deepseek_v4.loader.load_checkpoint`: quantized weights stay as
stored, experts sharded before reading), except:
- not read, for text-only serving: the vision tower and its aligner (`vision.*`, `aligner.*`,
  `image_start/end/newline`) and the MoE gates' image-token bias (`bias_vl`); any other tensor the model
  lacks fails the load (the DSpark stages, `mtp.*`, load like the main layers; a checkpoint without them
  loads without them);
- the Engram tables (`layers.N.engram.embed.weight` + `.scale`, `host_tables`) are checked against the
  layout the config implies and never copied into the process: mapped from the files, or from the node's
  one shared copy when the caller gives it (`host_tensors`, see `rackserve.models.node_tables`);
- the Engram token map is built from the checkpoint's tokenizer.json, whose compressed vocabulary
  must be the config's `engram_compressed_vocab_size` (every hash multiplier derives from it).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from rackserve.config import ConfigError
from rackserve.models.checkpoint import CheckpointError, StoredTensor, checkpoint_files, mapped_tensor, tensor_index
from rackserve.models.deepseek_v4.loader import load_checkpoint
from rackserve.models.deepseek_v41.config import ModelConfig
from rackserve.models.deepseek_v41.engram import SCALE_BLOCK, EngramTable, build_token_map
from rackserve.models.deepseek_v41.model import DeepseekV41ForCausalLM

# file names rackserve does not read (see the module docstring)
NOT_SERVED = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline)$)|\.gate\.bias_vl$")
ENGRAM_TABLE = re.compile(r"^layers\.(\d+)\.engram\.embed\.(weight|scale)$")


def skipped(name: str) -> bool:
    """Whether file tensor `name` is left out of the model's parameters (not served, or an Engram table)."""
    return bool(NOT_SERVED.search(name) or ENGRAM_TABLE.match(name))


def load_model(path: str | Path, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
               weights: str = "stored", shard: tuple | None = None,
               host_tensors: dict[str, torch.Tensor] | None = None) -> DeepseekV41ForCausalLM:
    """Build the model of the checkpoint at `path` and load its weights, Engram tables and token map;
    arguments as `rackserve.models.deepseek_v4.loader.load_model`. host_tensors: the `host_tables`
    by name, already in host memory (the node's shared copy); None maps them from the files."""
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    files = checkpoint_files(path)
    model = load_checkpoint(config, files, DeepseekV41ForCausalLM, dtype, device, weights, shard, skipped)
    if config.engram_layer_ids:
        model.engram_tables = engram_tables(config, files, host_tensors)
        model.ngram.setup(token_map(config, path))
    return model


def host_tables(path: str | Path) -> list[StoredTensor]:
    """The tensors of the checkpoint at `path` that are served from host memory: every Engram layer's
    codes and scales, in `engram_layer_ids` order, checked against the layout the config implies."""
    path = Path(path)
    return _table_entries(ModelConfig.from_pretrained(path), checkpoint_files(path))


def _table_entries(config: ModelConfig, files: list[Path]) -> list[StoredTensor]:
    layout, stored, entries = config.engram, tensor_index(files), []
    for i, layer in enumerate(config.engram_layer_ids):
        rows, d = layout.rows(i), config.engram_head_dim
        for suffix, dtype, shape in (("weight", torch.float8_e4m3fn, (rows, d)),
                                     ("scale", torch.float8_e8m0fnu, (rows, d // SCALE_BLOCK))):
            name = f"layers.{layer}.engram.embed.{suffix}"
            entry = stored.get(name)
            if entry is None:
                raise CheckpointError(f"the checkpoint has no {name}, the Engram table of layer {layer} "
                                      f"(engram_layer_ids={list(config.engram_layer_ids)})")
            if entry.shape != shape or entry.dtype != dtype:
                raise CheckpointError(f"{name} is {entry.dtype} {list(entry.shape)}; the config's Engram layout "
                                      f"needs {dtype} {list(shape)}")
            entries.append(entry)
    return entries


def engram_tables(config: ModelConfig, files: list[Path],
                  host_tensors: dict[str, torch.Tensor] | None = None) -> list[EngramTable]:
    """Every Engram layer's table, in `engram_layer_ids` order: from `host_tensors` (by name) if given,
    else memory-mapped from `files`."""
    entries = _table_entries(config, files)
    if host_tensors is not None:
        missing = [e.name for e in entries if e.name not in host_tensors]
        if missing:
            raise CheckpointError(f"the host tables given lack {missing}: they were made from another checkpoint")
        parts = [host_tensors[e.name] for e in entries]
    else:
        parts = [mapped_tensor(e.file, e.name) for e in entries]
    return [EngramTable(codes, scales) for codes, scales in zip(parts[::2], parts[1::2])]


def token_map(config: ModelConfig, path: Path) -> list[int]:
    """The Engram token map of the checkpoint's tokenizer, checked against `engram_compressed_vocab_size`."""
    from tokenizers import Tokenizer

    file = path / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"no tokenizer.json in {path}: DeepSeek-V4.1's Engram hashes token ids through a "
                              "map built from the checkpoint's tokenizer")
    lookup, size = build_token_map(Tokenizer.from_file(str(file)), config.vocab_size, config.engram_pad_token_id)
    if size != config.engram_compressed_vocab_size:
        raise ConfigError(f"the tokenizer in {path} compresses to {size} Engram ids but the config says "
                          f"engram_compressed_vocab_size={config.engram_compressed_vocab_size}: the tokenizer does not "
                          "belong to this checkpoint (every hash multiplier derives from that size)")
    return lookup
