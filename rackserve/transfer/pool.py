"""Byte ranges of one registered memory pool: first-fit allocation, neighbours merged on free."""

from __future__ import annotations

import bisect


class RangeAllocator:
    def __init__(self, size: int, align: int = 1):
        """Ranges of `[0, size)`; every range starts on a multiple of `align` and is rounded up to one."""
        self.size, self.align = size, align
        self._free: list[tuple[int, int]] = [(0, size)] if size > 0 else []  # (offset, length), by offset
        self._used: dict[int, int] = {}  # offset -> length

    @property
    def bytes_free(self) -> int:
        return sum(length for _, length in self._free)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a new range of at least `nbytes` (> 0), or None if no free run is long enough."""
        if nbytes <= 0:
            raise ValueError(f"nbytes={nbytes} must be > 0")
        need = -(-nbytes // self.align) * self.align
        for i, (offset, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, length - need)
                self._used[offset] = need
                return offset
        return None

    def free(self, offset: int) -> None:
        """Return the range at `offset` (from `alloc`)."""
        length = self._used.pop(offset, None)
        if length is None:
            raise ValueError(f"offset {offset} is not an allocated range")
        i = bisect.bisect(self._free, (offset, 0))
        if i < len(self._free) and offset + length == self._free[i][0]:  # merge with the next run
            length += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and with the previous
            offset, length = self._free[i - 1][0], self._free[i - 1][1] + length
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (offset, length))
