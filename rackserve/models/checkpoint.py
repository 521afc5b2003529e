"""Reading safetensors checkpoints, for any model family: which files a checkpoint directory has, what
tensors they hold (name, shape, dtype, without reading the data) and the error a mismatch raises.

How a family's names map to its model, and which tensors it reads, is the family loader's business.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import safe_open

# safetensors' dtype names
FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn,
               "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32,
               "I64": torch.int64}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message lists what is wrong."""


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: the index's shards, or model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e}); re-export the checkpoint") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shards listed in {index.name} are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")


@dataclass
class StoredTensor:
    """One tensor of the files: its name there, file, shape and dtype (the data is not read)."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


def tensor_index(files: list[Path]) -> dict[str, StoredTensor]:
    """Every tensor of `files`, by its name in the files."""
    entries = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                info = f.get_slice(name)
                dtype = FILE_DTYPES.get(info.get_dtype(), torch.float32)
                entries[name] = StoredTensor(name, file, tuple(info.get_shape()), dtype)
    return entries


def mapped_tensor(file: Path, name: str) -> torch.Tensor:
    """Tensor `name` of safetensors `file`, memory-mapped instead of read into memory: copy-on-write,
    read lazily and without read-ahead (for tables whose rows are fetched at random), its pages the page
    cache's, so every process of a node that maps the same file shares them."""
    try:
        with open(file, "rb") as f:
            offset, size, info = stored_span(f, name)
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, KeyError, ValueError, struct.error) as e:
        raise CheckpointError(f"cannot map tensor {name} of {file}: {e}; the file is truncated or not safetensors") \
            from None
    mapping.madvise(mmap.MADV_RANDOM)
    data = torch.frombuffer(mapping, dtype=torch.uint8, offset=offset, count=size)
    return data.view(FILE_DTYPES[info["dtype"]]).view(info["shape"])


def stored_span(f: BinaryIO, name: str) -> tuple[int, int, dict]:
    """Where tensor `name`'s bytes lie in the safetensors file open as `f` (read from its start): their
    offset from the file's start and their count, bytes, and its header entry (dtype, shape)."""
    (length,) = struct.unpack("<Q", f.read(8))
    info = json.loads(f.read(length))[name]
    start, end = info["data_offsets"]
    return 8 + length + start, end - start, info


def open_safetensors(file: Path):
    """`file` opened to read tensors on the CPU (a context manager); a `CheckpointError` if it is not safetensors."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise CheckpointError(f"cannot read {file}: {e}; the file is truncated or not safetensors") from None


def mismatch_message(missing: list[str], unexpected: list[str], misshaped: list[str], show: int = 8) -> str:
    """The `CheckpointError` message listing the tensors a checkpoint lacks, has too many of, or has mis-shaped."""
    parts = ["the checkpoint does not match the model config:"]
    for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped)):
        if names:
            more = f" … and {len(names) - show} more" if len(names) > show else ""
            parts.append(f"{len(names)} {label}: " + ", ".join(names[:show]) + more)
    parts.append("check that config.json belongs to these weights (same layer count, sizes and layer types)")
    return "\n  ".join(parts)
