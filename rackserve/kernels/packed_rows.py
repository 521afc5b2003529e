"""State rows stored block-scaled in FP8 or FP4: the byte layout, and reading it back.

A packed row of `dim` values is one byte row: the codes (FP8 e4m3: one byte a value; FP4 e2m1: two
values a byte, see `rackserve.kernels.quant`), then one scale per `block` values, in the row
format's `scale` format:

- "fp32": the codes zero-padded to a multiple of 4 bytes, then 4-byte fp32 scales (aligned, so a
  kernel reads them as fp32 words).
- "e4m3" / "ue8m0": the codes unpadded, then one byte a scale (float8_e4m3fn, or float8_e8m0fnu
  2^(byte − 127)). DeepSeek-V4.1's state: a 512-value entry FP4 with e4m3 scales per 16 is
  256 + 32 = 288 bytes, a 128-value indexer key FP4 with ue8m0 scales per 32 is 64 + 4 = 68.

All-zero bytes (fresh state memory) decode to zeros in every format. Codes and scales of a row sit
together, so moving the rows of a page moves everything needed to read them (one contiguous piece
per page, as the bf16 layout has), and a kernel reading a row touches one span of memory.

`PackedRows` is a tensor-like view of such rows for the code that reads and writes state: `rows[i]`
decodes the rows `i` into `dtype` (the dtype the values would have unpacked: the model's), and
`index_copy_` encodes values into rows. The Triton kernels read the bytes themselves
(`load_packed`), decoding in registers; decoded values are rounded to `dtype` as here, so kernels
and references see the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rackserve.kernels import dispatch
from rackserve.kernels.quant import (
    SCALE_DTYPES,
    SCALES,
    dequantize_fp4_torch,
    dequantize_fp8_torch,
    e2m1_value,
    e4m3_value,
    load_scales,
)

FORMATS = ("fp8", "fp4")


@dataclass(frozen=True)
class RowFormat:
    """`dim` values stored as `kind` ("fp8" or "fp4") codes with one scale per `block` of them, in
    format `scale` ("fp32", "e4m3" or "ue8m0": `rackserve.kernels.quant`)."""

    kind: str
    dim: int
    block: int
    scale: str = "fp32"

    def __post_init__(self) -> None:
        if self.kind not in FORMATS:
            raise ValueError(f"row format {self.kind!r}: use one of {FORMATS}")
        if self.scale not in SCALES:
            raise ValueError(f"row format scale={self.scale!r}: use one of {SCALES}")
        if self.block < 1 or (self.kind == "fp4" and self.block % 2):
            raise ValueError(f"block={self.block}: fp4 needs an even block (two codes share a byte)")

    @property
    def bits(self) -> int:
        return 8 if self.kind == "fp8" else 4

    @property
    def code_bytes(self) -> int:
        """Bytes of a row's codes, padded for fp32 scales so that they are 4-byte aligned."""
        codes = self.dim if self.kind == "fp8" else -(-self.dim // 2)
        return -(-codes // 4) * 4 if self.scale == "fp32" else codes

    @property
    def scale_bytes(self) -> int:
        return SCALE_DTYPES[self.scale].itemsize

    @property
    def groups(self) -> int:
        return -(-self.dim // self.block)

    @property
    def row_bytes(self) -> int:
        return self.code_bytes + self.scale_bytes * self.groups

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x `[N, dim]` (any float dtype) -> packed uint8 `[N, row_bytes]`."""
        quantize = dispatch.quantize_fp8 if self.kind == "fp8" else dispatch.quantize_fp4
        codes, scales = quantize(x.contiguous(), self.block, self.scale)
        out = torch.zeros(x.shape[0], self.row_bytes, dtype=torch.uint8, device=x.device)
        out[:, :codes.shape[1]] = codes
        out[:, self.code_bytes:] = scales.view(torch.uint8)
        return out

    def decode(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """packed uint8 `[..., row_bytes]` -> `[..., dim]` in `dtype` (computed in fp32, then rounded)."""
        lead = packed.shape[:-1]
        flat = packed.reshape(-1, self.row_bytes)
        scales = flat[:, self.code_bytes:].contiguous().view(SCALE_DTYPES[self.scale])
        if self.kind == "fp8":
            x = dequantize_fp8_torch(flat[:, :self.dim], scales, self.block, dtype)
        else:
            x = dequantize_fp4_torch(flat[:, :-(-self.dim // 2)], scales, self.block, self.dim, dtype)
        return x.view(*lead, self.dim)


@dataclass
class PackedRows:
    """Rows `[N, dim]` held as packed bytes `data` uint8 `[N, fmt.row_bytes]` (a view into state
    memory: writing through it writes the state), read and written like a `[N, dim]` tensor of
    `dtype`."""

    data: torch.Tensor
    fmt: RowFormat
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.fmt.dim))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        """The rows `index` (long, any shape) decoded: `[*index.shape, dim]` in `dtype`."""
        return self.fmt.decode(self.data[index], self.dtype)

    def index_copy_(self, dim: int, index: torch.Tensor, values: torch.Tensor) -> PackedRows:
        """Encode `values` `[M, dim]` into rows `index` `[M]` (dim must be 0)."""
        if dim != 0:
            raise ValueError("packed rows are written whole: index_copy_ along dim 0 only")
        self.data.index_copy_(0, index, self.fmt.encode(values))
        return self


def kernel_args(rows: torch.Tensor | PackedRows) -> tuple[torch.Tensor, torch.Tensor, int, int, int, str]:
    """What a kernel needs to read `rows` with `load_packed`: (bytes, fp32 words, scale column, block,
    bits, scale format). Scale g of row r is word `r · row_bytes / 4 + column + g` of the words for
    fp32 scales, byte `r · row_bytes + column + g` of the bytes for one-byte scales (the words then
    the bytes again: such rows need not be whole words). Bits 0 for a plain tensor (the rest unused)."""
    if not isinstance(rows, PackedRows):
        return rows, rows, 0, 1, 0, "fp32"
    fmt = rows.fmt
    if fmt.scale == "fp32":
        return rows.data, rows.data.view(torch.float32), fmt.code_bytes // 4, fmt.block, fmt.bits, fmt.scale
    return rows.data, rows.data, fmt.code_bytes, fmt.block, fmt.bits, fmt.scale


@triton.jit
def load_packed(data_ptr, words_ptr, row, ok, offs_d, mask_d, row_bytes, scale_col, block, BITS: tl.constexpr,
                SCALE: tl.constexpr):
    """Packed rows `row` `[R]` (where `ok`), channels `offs_d` `[C]` (where `mask_d`) -> fp32 `[R, C]`,
    0 where masked. Arguments as `kernel_args` gives them."""
    mask = ok[:, None] & mask_d[None, :]
    base = row.to(tl.int64)[:, None] * row_bytes
    if BITS == 8:
        value = e4m3_value(tl.load(data_ptr + base + offs_d[None, :], mask=mask, other=0).to(tl.int32))
    else:
        byte = tl.load(data_ptr + base + (offs_d // 2)[None, :], mask=mask, other=0).to(tl.int32)
        value = e2m1_value((byte >> (4 * (offs_d % 2))[None, :]) & 0xF)
    group = (offs_d // block)[None, :]
    if SCALE == "fp32":
        scale = load_scales(words_ptr + base // 4 + scale_col + group, mask, SCALE)
    else:
        scale = load_scales(data_ptr + base + scale_col + group, mask, SCALE)
    return value * scale
