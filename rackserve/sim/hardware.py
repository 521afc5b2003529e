"""Every number the simulator assumes about the machine, each with its source, in one place.

A `Hardware` preset is one GPU model inside its rack (peak rates per GPU, dense, no sparsity);
`Host` is what the CPUs and the host network cost per engine step; `Efficiency` holds the few
global factors that turn peaks into achievable rates. Each preset carries `sources`: field name ->
where the value comes from, or "assumed: why". `assumption_rows()` lists them all for tables and
docs (`rackserve sim validate` prints it below its table).

Units: FLOP/s, bytes/s, bytes, seconds. 1 TB = 1e12 bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class Hardware:
    """One GPU of a rack-scale system.

    flops: dense tensor-core FLOP/s per compute dtype ("fp4", "fp8", "bf16"); a dtype the GPU lacks
      (FP4 on Hopper) is absent and runs at the next wider one.
    nvlink_bytes_per_s: per GPU, per direction. network_*: the scale-out NIC per GPU (used when an
      instance is larger than one NVLink domain). host_link_bytes_per_s: host memory -> GPU (the KV
      store's prefixes come this way). disk_bytes_per_s: a host's local NVMe, read (a KV store's disk tier).
    """

    name: str
    flops: Mapping[str, float]
    hbm_bytes_per_s: float
    hbm_bytes: float
    nvlink_bytes_per_s: float
    nvlink_latency_s: float
    nvlink_domain: int
    network_bytes_per_s: float
    network_latency_s: float
    host_link_bytes_per_s: float
    gpus_per_host: int
    disk_bytes_per_s: float
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def flop_rate(self, dtype: str) -> float:
        """Peak dense FLOP/s for matmuls in `dtype`, falling back fp4 -> fp8 -> bf16."""
        order = ("fp4", "fp8", "bf16")
        for d in order[order.index(dtype):]:
            if d in self.flops:
                return self.flops[d]
        raise ValueError(f"{self.name} has no tensor rate for {dtype!r} or wider; give one of {order}")


@dataclass(frozen=True)
class Host:
    """Per-step CPU costs of one DP rank and its host sync.

    step_s + per_request_s × running requests: schedule, build inputs, sample, process outputs.
    hop_s: one message of the host collective between hosts (kernel TCP); local_hop_s within a host.
    jitter_s: mean of a rank's random extra host time per step (exponential): the gang waits for the
      slowest rank, E[max of P] = jitter_s × H_P (harmonic number).
    """

    step_s: float
    per_request_s: float
    hop_s: float
    local_hop_s: float
    jitter_s: float
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Efficiency:
    """Achievable fraction of each peak, global to every preset and figure, plus fixed GPU costs.

    gemm: dense and grouped matmuls; attention: attention and indexer cores; hbm, nvlink: memory and
    link bandwidth; layer_overhead_s: per layer per forward pass (launch gaps, small kernels: norms,
    mHC Sinkhorn, routing), with CUDA graphs.
    """

    gemm: float = 0.6
    attention: float = 0.4
    hbm: float = 0.8
    nvlink: float = 0.7
    layer_overhead_s: float = 20e-6
    sources: Mapping[str, str] = field(default_factory=lambda: {
        "gemm": "assumed: typical large-GEMM fraction of dense peak for FP8/FP4 kernels",
        "attention": "assumed: sparse/windowed attention kernels reach less of peak than GEMMs",
        "hbm": "assumed: streaming kernels reach ~80% of HBM peak",
        "nvlink": "assumed: all-to-all over NVLink reaches ~70% of link peak",
        "layer_overhead_s": "assumed: ~10 small kernels per layer at ~2 us each under CUDA graphs",
    }, compare=False)


GB300 = Hardware(
    name="gb300",
    flops={"fp4": 15e15, "fp8": 5e15, "bf16": 2.5e15},
    hbm_bytes_per_s=8e12,
    hbm_bytes=288e9,
    nvlink_bytes_per_s=900e9,
    nvlink_latency_s=10e-6,
    nvlink_domain=72,
    network_bytes_per_s=100e9,
    network_latency_s=5e-6,
    host_link_bytes_per_s=450e9,
    gpus_per_host=4,
    disk_bytes_per_s=28e9,
    sources={
        "flops": "NVIDIA Blackwell Ultra: 15 PFLOPS dense NVFP4 per GPU; GB300 NVL72 sheet: 720 PFLOPS FP8 and "
                 "360 PFLOPS BF16 per rack with sparsity -> 5 / 2.5 PFLOPS dense per GPU",
        "hbm_bytes_per_s": "GB300 NVL72 sheet: 576 TB/s HBM3e per 72 GPUs",
        "hbm_bytes": "GB300: 288 GB HBM3e per GPU",
        "nvlink_bytes_per_s": "NVLink 5: 1.8 TB/s per GPU, both directions together",
        "nvlink_latency_s": "assumed: one dispatch or combine kernel's fixed cost over NVLink",
        "nvlink_domain": "NVL72: 72 GPUs in one NVLink domain",
        "network_bytes_per_s": "ConnectX-8: 800 Gb/s per GPU",
        "network_latency_s": "assumed: RDMA one-way latency",
        "host_link_bytes_per_s": "NVLink-C2C Grace <-> GPU: 900 GB/s both directions",
        "gpus_per_host": "GB300 NVL72 compute tray: 4 GPUs",
        "disk_bytes_per_s": "assumed: a compute tray's local E1.S NVMe, two PCIe Gen5 drives at ~14 GB/s read each",
    },
)

H200 = Hardware(
    name="h200",
    flops={"fp8": 1.979e15, "bf16": 0.989e15},
    hbm_bytes_per_s=4.8e12,
    hbm_bytes=141e9,
    nvlink_bytes_per_s=450e9,
    nvlink_latency_s=10e-6,
    nvlink_domain=8,
    network_bytes_per_s=50e9,
    network_latency_s=5e-6,
    host_link_bytes_per_s=55e9,
    gpus_per_host=8,
    disk_bytes_per_s=28e9,
    sources={
        "flops": "H200 SXM sheet: 3,958 / 1,979 TFLOPS FP8 / BF16 with sparsity -> half dense; no FP4 tensor cores",
        "hbm_bytes_per_s": "H200 SXM sheet: 4.8 TB/s",
        "hbm_bytes": "H200 SXM sheet: 141 GB HBM3e",
        "nvlink_bytes_per_s": "NVLink 4: 900 GB/s per GPU, both directions together",
        "nvlink_latency_s": "assumed: one dispatch or combine kernel's fixed cost over NVLink",
        "nvlink_domain": "HGX H200: 8 GPUs per NVLink domain",
        "network_bytes_per_s": "ConnectX-7: 400 Gb/s per GPU",
        "network_latency_s": "assumed: RDMA one-way latency",
        "host_link_bytes_per_s": "assumed: PCIe 5.0 x16, ~55 GB/s achievable one way",
        "gpus_per_host": "HGX H200: 8 GPUs per host",
        "disk_bytes_per_s": "assumed: two of the host's PCIe Gen5 NVMe drives at ~14 GB/s read each",
    },
)

HOST = Host(
    step_s=0.5e-3,
    per_request_s=4e-6,
    hop_s=25e-6,
    local_hop_s=3e-6,
    jitter_s=0.1e-3,
    sources={
        "step_s": "assumed: Python engine step with CUDA graphs (schedule, inputs, sampling, outputs)",
        "per_request_s": "assumed: per running request bookkeeping and output processing",
        "hop_s": "assumed: one TCP message between hosts incl. the collective's own framing",
        "local_hop_s": "assumed: shared-memory hop within a host",
        "jitter_s": "assumed: mean random host delay per rank and step (GC, OS scheduling)",
    },
)

PRESETS = {hw.name: hw for hw in (GB300, H200)}


def preset(name: str) -> Hardware:
    """The hardware preset called `name` ("gb300" or "h200")."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"no hardware preset {name!r}; use one of {sorted(PRESETS)}") from None


def assumption_rows(hw: Hardware, host: Host = HOST, eff: Efficiency | None = None) -> list[tuple[str, str, str]]:
    """(name, value, source) for every number of `hw`, `host` and `eff`."""
    eff = eff or Efficiency()
    rows = []
    for prefix, obj in ((hw.name, hw), ("host", host), ("efficiency", eff)):
        for f in fields(obj):
            if f.name in ("name", "sources"):
                continue
            rows.append((f"{prefix}.{f.name}", _fmt(getattr(obj, f.name)), obj.sources.get(f.name, "")))
    return rows


def _fmt(value) -> str:
    if isinstance(value, Mapping):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
