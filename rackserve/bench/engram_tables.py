"""What the node's one copy of the Engram tables costs and gives: publishing it, and the row gathers of a
step read from it, against the alternatives a rank could use and against the machine's copy bandwidth.

    python -m rackserve.bench.engram_tables [--gib 1] [--tokens 1,64,1024,8192] [--iters 7]

A synthetic table of `--gib` GiB of FP8 codes at V4.1-Flash's row width (256 bytes, plus its UE8M0
scales: one byte per 32) is written as a safetensors file, then published as a node set
(`NodeTables.publish`: GB/s against one `torch.clone` of a 256 MiB tensor, the copy limit). Then, for
`--tokens` tokens of one Engram layer (V4.1-Flash: 8 heads × 3 n-gram orders = 24 rows per token, rows
uniform at random, the hashes' worst case for locality), the median ms of `EngramTable.lookup`
(gather + dequantize to bf16) and of the bare gather (`index_select` of the codes) in the batch's order
and sorted by row (what sorting could save at most: the sort and the way back are not counted), from:
- the node set (shared tmpfs pages, `table_huge_pages` as granted by this machine's
  `transparent_hugepage/shmem_enabled`), what every rank reads;
- a private copy per rank in 4 KB pages (what loading the tables into each rank would give);
- a private copy in 2 MB pages (`MADV_HUGEPAGE` on anonymous memory: what a node set gets where the
  file system grants huge pages, hugetlbfs or tmpfs with `huge=`), with the share of it that the kernel
  actually backed by huge pages.
Gathered bytes per second are set against the copy bandwidth. Memory: a shared set costs one copy per
node, a private one a copy per rank (`--gib` × ranks); that column is arithmetic, not measured.

The last line printed is one JSON object with the headline figures. The machine may be shared and
noisy: read the ratios rather than the absolute times.
"""

from __future__ import annotations

import functools
import mmap
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from rackserve.bench import script
from rackserve.bench.model import median_ms
from rackserve.models.checkpoint import tensor_index
from rackserve.models.deepseek_v41.engram import SCALE_BLOCK, EngramTable
from rackserve.models.node_tables import NodeTables

ROW = 256  # bytes (FP8 codes) of one V4.1-Flash Engram row: engram_head_dim
ROWS_PER_TOKEN = 24  # one layer: engram_n_heads (8) × n-gram orders 2..4 (3)
RANKS_PER_NODE = 4  # a GB300 tray's GPUs, for the memory column


def write_table(directory: Path, gib: float) -> list:
    """A random table of `gib` GiB of codes (+ scales) as a safetensors file; its `StoredTensor`s."""
    rows = int(gib * 2**30) // ROW
    codes = torch.randint(0, 127, (rows, ROW), dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.randint(120, 134, (rows, ROW // SCALE_BLOCK), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    file = directory / "model.safetensors"
    save_file({"table.weight": codes, "table.scale": scales}, str(file))
    index = tensor_index([file])
    return [index["table.weight"], index["table.scale"]]


def private_copy(source: torch.Tensor, huge: bool) -> tuple[torch.Tensor, float]:
    """`source` copied into fresh anonymous memory in 4 KB or (asked for) 2 MB pages; the share of the
    copy's memory the kernel backed by huge pages."""
    size = source.numel() * source.element_size()
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    copy = torch.frombuffer(mapping, dtype=torch.uint8, count=size).view(source.dtype).view(source.shape)
    copy.view(torch.uint8).copy_(source.view(torch.uint8))
    return copy, huge_share(copy)


def huge_share(t: torch.Tensor) -> float:
    """The share of `t`'s memory that this process's page tables map with huge pages (smaps)."""
    start, huge, size, inside = t.data_ptr(), 0, 0, False
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for line in lines:
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            inside = lo <= start < hi
        elif inside and fields[0] in ("AnonHugePages:", "FilePmdMapped:", "ShmemPmdMapped:"):
            huge += int(fields[1]) << 10
        elif inside and fields[0] == "Size:":
            size += int(fields[1]) << 10
    return huge / size if size else 0.0


def copy_gbps(iters: int) -> float:
    block = torch.empty(256 << 20, dtype=torch.uint8).fill_(1)
    return block.numel() / median_ms(block.clone, iters) / 1e6


def measure(gib: float, tokens: list[int], iters: int) -> dict:
    with tempfile.TemporaryDirectory() as src, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        stored = write_table(Path(src), gib)
        tables = NodeTables(shm, "bench", tuple(stored))
        publish_s = tables.publish(huge_pages=True)
        shared = tables.map(huge_pages=True)
        codes, scales = shared["table.weight"], shared["table.scale"]
        kinds = {"node set (shared)": (EngramTable(codes, scales), huge_share(codes))}
        for name, huge in (("private, 4 KB pages", False), ("private, 2 MB pages", True)):
            c, share = private_copy(codes, huge)
            kinds[name] = (EngramTable(c, private_copy(scales, huge)[0]), share)
        rows = codes.shape[0]
        gen = torch.Generator().manual_seed(0)
        out = {"gib": gib, "publish_gbps": tables.nbytes / publish_s / 1e9, "copy_gbps": copy_gbps(iters),
               "rows": []}
        for kind, (table, share) in kinds.items():
            for n in tokens:
                index = torch.randint(0, rows, (n, ROWS_PER_TOKEN), generator=gen)
                flat = index.reshape(-1)
                order = flat.sort().values
                out["rows"].append({
                    "memory": kind, "huge_share": share, "tokens": n,
                    "lookup_ms": median_ms(functools.partial(table.lookup, index, torch.bfloat16), iters),
                    "gather_ms": median_ms(functools.partial(table.codes.index_select, 0, flat), iters),
                    "sorted_gather_ms": median_ms(functools.partial(table.codes.index_select, 0, order), iters),
                })
        del kinds, shared, codes, scales
        return out


def table(m: dict) -> str:
    lines = [f"publish {m['gib']:.2f} GiB: {m['publish_gbps']:.2f} GB/s; copy limit {m['copy_gbps']:.2f} GB/s",
             f"{'memory':<22} {'huge':>5} {'tokens':>6} {'lookup ms':>10} {'gather ms':>10} {'sorted ms':>10} "
             f"{'sorted x':>8} {'GB/s':>6} {'node GiB':>8}"]
    for r in m["rows"]:
        node = m["gib"] * (1 if r["memory"].startswith("node") else RANKS_PER_NODE)
        gbps = r["tokens"] * ROWS_PER_TOKEN * ROW / r["gather_ms"] / 1e6
        lines.append(f"{r['memory']:<22} {r['huge_share']:>5.2f} {r['tokens']:>6} {r['lookup_ms']:>10.3f} "
                     f"{r['gather_ms']:>10.3f} {r['sorted_gather_ms']:>10.3f} "
                     f"{r['gather_ms'] / r['sorted_gather_ms']:>8.2f} {gbps:>6.2f} {node:>8.2f}")
    return "\n".join(lines)


def figures(m: dict) -> dict:
    most = max(r["tokens"] for r in m["rows"])
    at = {r["memory"]: r for r in m["rows"] if r["tokens"] == most}
    shared, small, huge = at["node set (shared)"], at["private, 4 KB pages"], at["private, 2 MB pages"]
    return {"bench": "engram_tables", "gib": m["gib"], "tokens": most, "publish_gbps": round(m["publish_gbps"], 3),
            "copy_gbps": round(m["copy_gbps"], 3),
            "gather_gbps": round(most * ROWS_PER_TOKEN * ROW / shared["gather_ms"] / 1e6, 3),
            "shared_vs_private_4k": round(small["gather_ms"] / shared["gather_ms"], 3),
            "huge_vs_4k": round(small["gather_ms"] / huge["gather_ms"], 3),
            "sorted_speedup": round(shared["gather_ms"] / shared["sorted_gather_ms"], 3),
            "shared_huge_share": round(shared["huge_share"], 3), "private_huge_share": round(huge["huge_share"], 3),
            "node_bytes_ratio": RANKS_PER_NODE}


def main(argv: list[str] | None = None) -> dict:
    ap = script.parser(__doc__)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tokens", type=script.int_list, default="1,64,1024,8192")
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args(argv)
    measured = measure(args.gib, args.tokens, args.iters)
    print(table(measured))
    return script.headline(figures(measured))


if __name__ == "__main__":
    main()
