"""Values for all-gather and broadcast: msgpack, with numpy arrays as a msgpack extension type.

Anything msgpack can carry (None, bool, int, float, str, bytes, list, dict) plus numeric numpy
arrays and scalars, nested freely. Tuples come back as lists. Never pickle: a peer's bytes are
only ever parsed as msgpack and raw array memory.
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np

_ARRAY = 1  # msgpack ext code: u16 meta length | msgpack [dtype.str, shape] | raw C-order bytes
_META_LEN = struct.Struct("!H")
_ARRAY_KINDS = "biufc"  # bool, ints, floats, complex: plain memory, nothing to execute


def _encode_ext(obj):
    if isinstance(obj, np.ndarray) and obj.dtype.kind in _ARRAY_KINDS:
        arr = np.ascontiguousarray(obj)
        meta = msgpack.packb([arr.dtype.str, list(arr.shape)])
        return msgpack.ExtType(_ARRAY, _META_LEN.pack(len(meta)) + meta + arr.tobytes())
    if isinstance(obj, np.generic) and obj.dtype.kind in _ARRAY_KINDS:
        return obj.item()
    raise TypeError(f"cannot send a {type(obj).__name__} through the collective: values must be "
                    "msgpack-able (None, bool, int, float, str, bytes, list, dict) or numeric "
                    "numpy arrays; convert it first (nothing is pickled on this path)")


def _decode_ext(code: int, data: bytes):
    if code != _ARRAY:
        raise ValueError(f"unknown msgpack extension type {code}")
    (meta_len,) = _META_LEN.unpack_from(data)
    dtype_str, shape = msgpack.unpackb(data[_META_LEN.size:_META_LEN.size + meta_len])
    dtype = np.dtype(dtype_str)
    if dtype.kind not in _ARRAY_KINDS:
        raise ValueError(f"refusing array of dtype {dtype_str!r}")
    raw = data[_META_LEN.size + meta_len:]
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()  # copy: writable, owns memory


def pack(value) -> bytes:
    """Encode one value (see module docstring) to bytes."""
    return msgpack.packb(value, default=_encode_ext, use_bin_type=True)


def unpack(data: bytes):
    """Decode bytes from ``pack``; ValueError (or a msgpack error) on malformed input."""
    return msgpack.unpackb(data, ext_hook=_decode_ext, raw=False, strict_map_key=False)
