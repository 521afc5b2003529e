"""Large read-only tensors held once per node in shared memory (DeepSeek-V4.1's Engram tables: 189 GiB).

A `NodeTables` is a directory of raw tensor files on a memory file system (`/dev/shm` by default, a
hugetlbfs mount for 2 MB pages): `publish` copies the tensors, as stored (FP8 codes, UE8M0 scales),
from the checkpoint's safetensors files into it in large sequential reads, then makes it visible with
one rename, so a set that exists is complete; `map` gives every process of the node the same pages
(a shared read of one copy: N ranks, one copy). A set is named by the node, its root and the checkpoint's
files (path, size, modification time), so two checkpoints, two roots, or two nodes of one machine (a
test cluster), never share one by mistake. `remove` unlinks it; pages already mapped stay valid until the
last process unmaps them. `sweep` removes the sets and partial sets whose owner process is gone
(what a killed cluster leaves behind); `mappers` finds the processes that map a set.

No Ray here: `rackserve.actors.table_host.TableHost` is the node's owner of a set.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import mmap
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from rackserve.config import ConfigError
from rackserve.models.checkpoint import FILE_DTYPES, CheckpointError, StoredTensor, stored_span

PREFIX = "rackserve-tables-"
OWNER = "owner"  # the owning process's pid, a file of every set
CHUNK = 64 << 20  # bytes per read while publishing
HUGE_PAGE = 2 << 20
_DTYPE_NAMES = {dtype: name for name, dtype in FILE_DTYPES.items()}


@dataclass(frozen=True)
class NodeTables:
    """The set of `tensors` (their names, files, shapes and dtypes in the checkpoint) for `node`
    under `root`. Its name is derived from all three (`directory`)."""

    root: str
    node: str
    tensors: tuple[StoredTensor, ...]

    @functools.cached_property  # named once: from then on the set is the one the files had then
    def directory(self) -> Path:
        key = hashlib.sha256(str(Path(self.root).resolve()).encode())  # the name is its host actor's too
        for t in self.tensors:
            stat = Path(t.file).stat()
            key.update(json.dumps([t.name, str(Path(t.file).resolve()), stat.st_size, stat.st_mtime_ns]).encode())
        return Path(self.root) / f"{PREFIX}{self.node[:12]}-{key.hexdigest()[:16]}"

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors)

    def exists(self) -> bool:
        return self.directory.is_dir()

    def publish(self, huge_pages: bool = False) -> float:
        """Copy every tensor into a fresh set (seconds taken). With `huge_pages`, ask for 2 MB pages
        (`MADV_HUGEPAGE`; granted where the file system gives them: a hugetlbfs root, or tmpfs with
        `transparent_hugepage/shmem_enabled` on). A `ConfigError` when the file system has no room."""
        begin = time.monotonic()
        root = Path(self.root)
        if not root.is_dir():
            raise ConfigError(f"table_dir={self.root!r} is not a directory: point it at a memory file system "
                              "(/dev/shm, or a hugetlbfs mount) on every node")
        disk = shutil.disk_usage(root)
        if disk.free < self.nbytes:
            raise ConfigError(f"{self.root} has {disk.free / 2**30:.2f} GiB free; the node's host tables need "
                              f"{self.nbytes / 2**30:.2f} GiB: enlarge it (docker: --shm-size; Kubernetes: an "
                              "emptyDir with medium Memory and a sizeLimit) or set table_dir to a larger one")
        partial = root / f".{self.directory.name}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        try:
            for t in self.tensors:
                _copy(t, partial / _file_name(t), huge_pages)
            (partial / OWNER).write_text(str(os.getpid()))
            partial.rename(self.directory)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        return time.monotonic() - begin

    def adopt(self) -> None:
        """Become the owner of an existing set (a restarted owner takes over what its predecessor made)."""
        mine = self.directory / f".{OWNER}-{os.getpid()}"
        mine.write_text(str(os.getpid()))
        mine.replace(self.directory / OWNER)  # at once: a sweep never reads a half-written owner

    def map(self, huge_pages: bool = False) -> dict[str, torch.Tensor]:
        """Every tensor of the set by its checkpoint name, mapped from the node's one copy: shared and
        read-only (a private mapping of a hugetlbfs file would reserve huge pages for copies on write, a
        second copy per rank; nothing writes the tables, and a write would fault, not change the set)."""
        out = {}
        for t in self.tensors:
            with open(self.directory / _file_name(t), "rb") as f:
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            mapping.madvise(mmap.MADV_HUGEPAGE if huge_pages else mmap.MADV_RANDOM)
            with warnings.catch_warnings():  # torch warns that the buffer is not writable: it is meant not to be
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(mapping, dtype=torch.uint8, count=_nbytes(t))
            out[t.name] = data.view(t.dtype).view(t.shape)
        return out

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def sweep(root: str | Path, keep: Path | None = None) -> list[Path]:
    """Remove the sets and partial sets under `root` whose owner process no longer runs on this machine,
    except `keep`; the paths removed."""
    removed = []
    for path in Path(root).glob(f"*{PREFIX}*"):
        if path == keep or not path.is_dir():
            continue
        if path.name.startswith("."):
            pid = path.name.rpartition("-")[2]
        else:
            owner = path / OWNER
            pid = owner.read_text() if owner.is_file() else ""
        if not (pid.isdigit() and alive(int(pid))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def mappers(directory: Path) -> list[int]:
    """The pids of this machine's processes that map a file of `directory` (from /proc/*/maps: what the
    kernel says, whoever the process is; a process whose maps cannot be read is not counted)."""
    found, needle = [], str(directory) + "/"
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if needle in maps.read_text():
                found.append(int(maps.parent.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return sorted(found)


def alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _file_name(t: StoredTensor) -> str:
    return f"{t.name}.{_DTYPE_NAMES[t.dtype]}"


def _nbytes(t: StoredTensor) -> int:
    return math.prod(t.shape) * t.dtype.itemsize


def _copy(t: StoredTensor, out: Path, huge_pages: bool) -> None:
    """Write tensor `t`'s bytes from its safetensors file into a new file `out`, through a mapping of
    `out` (hugetlbfs files can only be written that way), in `CHUNK`-sized sequential reads."""
    size = _nbytes(t)
    with open(t.file, "rb") as src:
        offset, stored, _ = stored_span(src, t.name)
        if stored != size:
            raise CheckpointError(f"{t.name} in {t.file} holds {stored} bytes, not the {size} of its shape")
        src.seek(offset)
        with open(out, "w+b") as dst:
            dst.truncate(-(-size // HUGE_PAGE) * HUGE_PAGE if huge_pages else max(size, 1))
            with mmap.mmap(dst.fileno(), 0) as mapping:
                if huge_pages:
                    mapping.madvise(mmap.MADV_HUGEPAGE)
                with memoryview(mapping) as view:
                    for at in range(0, size, CHUNK):
                        if src.readinto(view[at:min(size, at + CHUNK)]) != min(CHUNK, size - at):
                            raise CheckpointError(f"{t.file} ended inside {t.name}: the file is truncated")
