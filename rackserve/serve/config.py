"""What `rackserve serve` runs: one deployment behind one OpenAI-compatible endpoint."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from rackserve.cluster.request_router import RoutingConfig
from rackserve.config import ConfigError, EngineConfig
from rackserve.placement.planner import NO_PREFILL, RANK_PROCESS_BYTES, HostDemand

BUILDER = "rackserve.serve.app:build"
# `rackserve serve` without a config (the quick start: one machine): one DEP1 instance prefilling what it decodes,
# running up to 128 requests with 2048-token steps (vLLM's CPU server defaults). On a 2-core machine with the tiny
# Qwen3-MoE over HTTP (`python -m rackserve.bench.peer`) it streams 1.1-1.2x the output tokens/s of P/D with DEP1
# instances at 1-64 streams, and 1.9-5.4x those of P/D with DEP2 instances and a KV store (`ServeConfig`'s
# defaults, rack-shaped): ranks in lockstep contend for two cores, and a push adds a hop that one machine gains
# nothing from. 128 running (not the engine's 32) serve 64 streams at once: TTFT p50 0.3-0.4 s, not 2.2
QUICK_START = {"prefill": NO_PREFILL, "decode": "1xDEP1", "kv_stores": 0,
               "engine": {"max_num_seqs": 128, "max_num_batched_tokens": 2048}}
INGRESS_KINDS = ("proxy", "direct")  # how HTTP reaches the replicas: see `rackserve.serve.ingress`
# settings of the HTTP tier alone: changing them restarts ingress replicas, never the engines
INGRESS_FIELDS = ("served_model_name", "host", "port", "ingress", "api_key", "max_inflight", "num_ingress_replicas",
                  "ingress_resources", "drain_timeout_s", "routing")


@dataclass(frozen=True)
class ServeConfig:
    """model: "tiny" or "tiny-code" (built in) or a checkpoint directory; served_model_name: the `model`
    clients send (default: the built-in name or the checkpoint directory's name); prefill / decode: instance shapes
    ("1xDEP2", "2xAFD2+2"; prefill "none": decode instances that prefill what they serve); kv_stores:
    KV-store actors (a number), or with a topology their layout ("per_tray", "per_rack", "none"); engine:
    `EngineConfig` fields of every rank, prefill_engine / decode_engine: more of them for one role;
    decode_redundant_slots: extra expert slots per decode instance (EPLB replicas); topology: place the
    instances with the rack
    planner on this topology ("ray": read from the cluster's node labels, else a topology file);
    bundle_resources: what one rank's placement-group bundle reserves (default {"GPU": 1});
    host, port: where the endpoint listens; ingress: "proxy" (Serve's HTTP proxy, any cluster) or
    "direct" (the replica serves HTTP itself, skipping a hop each way; the cluster must be started
    for it, see `rackserve.serve.ingress`);
    api_key: when set, requests need `Authorization: Bearer <api_key>`; max_inflight: requests in
    progress per ingress replica before new ones get 429 (backpressure, not an unbounded queue);
    num_ingress_replicas: stateless HTTP replicas in front of the one data plane (each routes and
    streams by itself; with direct ingress each listens on its own port from `port` on);
    ingress_resources: Ray resources each ingress replica reserves, to keep the HTTP tier off the GPU
    trays (e.g. {"ingress": 1} where the CPU nodes are started with `--resources '{"ingress": 4}'`): a
    replica's HTTP connections die with its node, while the engines' requests are replayed;
    drain_timeout_s (s): how long `rackserve serve`, told to stop (SIGTERM, Ctrl-C), lets the requests in
    progress finish while new ones get 503 + Retry-After; what still runs then is ended with an error; and
    how long an ingress replica a redeploy replaces lets its requests finish (what still runs then is cut);
    timeout (s): a gang member silent this long fails its instance;
    store_memory_mb: each KV store's host memory for cached prefixes; store_disk_mb: its local-disk
    tier below that (blocks evicted from memory, read back on a hit; 0: none), in store_disk_path on
    the store's node (default: its temporary directory);
    routing: how the ingress replicas route requests (`rackserve.cluster.request_router.RoutingConfig`'s
    fields: policy "cache_aware" | "session" | "least_loaded" and the cost's weights; its
    index_entries bounds the data plane's block index from the data plane's next start)."""

    model: str = "tiny"
    served_model_name: str | None = None
    prefill: str = "1xDEP2"
    decode: str = "1xDEP2"
    kv_stores: int | str = 1
    engine: dict = field(default_factory=dict)
    prefill_engine: dict = field(default_factory=dict)
    decode_engine: dict = field(default_factory=dict)
    decode_redundant_slots: int = 0
    topology: str | None = None
    bundle_resources: dict | None = None
    store_memory_mb: float = 256.0
    store_disk_mb: float = 0.0
    store_disk_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    ingress: str = "proxy"
    api_key: str | None = None
    max_inflight: int = 256
    num_ingress_replicas: int = 1
    ingress_resources: dict | None = None
    drain_timeout_s: float = 30.0
    timeout: float = 30.0
    routing: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        RoutingConfig.from_dict(self.routing)  # refused here, naming the setting, not in a replica
        if isinstance(self.kv_stores, str) != (self.topology is not None):
            raise ConfigError(f"kv_stores={self.kv_stores!r}: give a number without a topology, and a layout "
                              "('per_tray', 'per_rack' or 'none') with one")
        if not isinstance(self.max_inflight, int) or self.max_inflight < 1:
            raise ConfigError(f"max_inflight={self.max_inflight!r} must be an integer ≥ 1")
        if not isinstance(self.num_ingress_replicas, int) or self.num_ingress_replicas < 1:
            raise ConfigError(f"num_ingress_replicas={self.num_ingress_replicas!r} must be an integer ≥ 1")
        if self.ingress_resources is not None and not (
                isinstance(self.ingress_resources, dict) and all(
                    isinstance(k, str) and isinstance(v, (int, float)) and v >= 0
                    for k, v in self.ingress_resources.items())):
            raise ConfigError(f"ingress_resources={self.ingress_resources!r} must map Ray resource names to amounts "
                              '≥ 0, e.g. {"ingress": 1}')
        if not isinstance(self.drain_timeout_s, (int, float)) or not self.drain_timeout_s >= 0:
            raise ConfigError(f"drain_timeout_s={self.drain_timeout_s!r} must be a number of seconds ≥ 0")
        if not isinstance(self.store_disk_mb, (int, float)) or not self.store_disk_mb >= 0:
            raise ConfigError(f"store_disk_mb={self.store_disk_mb!r} must be a number of MiB ≥ 0 (0: no disk tier)")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(f"port={self.port!r} must be an integer in [0, 65535]")
        if self.prefill == NO_PREFILL and self.topology is not None:
            raise ConfigError(f"prefill={NO_PREFILL!r} with a topology: the rack planner places prefill and decode "
                              "instances both; give a prefill shape (e.g. '1xDEP2'), or no topology")
        if self.ingress not in INGRESS_KINDS:
            raise ConfigError(f"ingress={self.ingress!r} must be one of {INGRESS_KINDS}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or ("tiny" if self.model == "tiny" else Path(self.model).name)

    @classmethod
    def from_dict(cls, raw: dict) -> ServeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown serve setting(s) {unknown}; known: {sorted(known)}")
        return cls(**raw)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ServeConfig:
        """Read a serve config file: a Ray Serve config (deploy/tiny-cpu.yaml: the args of the app
        built by `rackserve.serve.app:build`, with host and port from its http_options) or a plain
        mapping of these fields."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"no serve config at {path}; see deploy/tiny-cpu.yaml for an example")
        raw = yaml.safe_load(path.read_text()) or {}
        if "applications" not in raw:
            return cls.from_dict(raw)
        apps = [a for a in raw["applications"] if a.get("import_path") == BUILDER]
        if len(apps) != 1:
            raise ConfigError(f"{path} must have exactly one application with import_path {BUILDER}")
        http = {k: v for k, v in (raw.get("http_options") or {}).items() if k in ("host", "port")}
        return cls.from_dict({**http, **(apps[0].get("args") or {})})

    def host_demand(self, model) -> HostDemand:
        """What this config puts in a tray's host memory for `model` (its config, `ModelSpec`): the model's
        host tables, `store_memory_mb` per KV store, and per DP rank `RANK_PROCESS_BYTES` plus, on a CPU
        rank, its NIXL pool and state memory (a GPU rank keeps both on the GPU)."""
        def rank(role: dict) -> int:
            engine = EngineConfig(**{**self.engine, **role})
            host_mb = engine.kv_pool_mb + engine.state_memory_mb if engine.device == "cpu" else 0
            return RANK_PROCESS_BYTES + int(host_mb * 2**20)

        return HostDemand(model.host_table_bytes, int(self.store_memory_mb * 2**20), rank(self.prefill_engine),
                          rank(self.decode_engine))

    def to_dict(self) -> dict:
        return asdict(self)
