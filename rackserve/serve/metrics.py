"""Prometheus metrics of the endpoint: requests, latencies, tokens, state memory, EPLB, KV transfers,
faults and recovery.

Request-path figures are recorded as requests run; deployment-wide figures (state memory, EPLB
balancedness, KV transfer counters) are read from the ranks when `/metrics` is scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("rackserve_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.inflight = Gauge("rackserve_requests_inflight", "Requests in progress", registry=r)
        self.ttft = Histogram("rackserve_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("rackserve_time_per_output_token_seconds", "Mean time between output tokens",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("rackserve_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("rackserve_cached_prompt_tokens", "Prompt tokens served by a prefix cache",
                                     registry=r)
        self.output_tokens = Counter("rackserve_generation_tokens", "Output tokens (rate() = tokens/s)", registry=r)
        self.state_bytes = Gauge("rackserve_state_bytes_in_use", "State memory held by requests, by role", ["role"],
                                 registry=r)
        self.cached_bytes = Gauge("rackserve_state_bytes_cached", "State memory held by the prefix cache only "
                                  "(reclaimable), by role", ["role"], registry=r)
        self.running = Gauge("rackserve_engine_requests", "Requests in the engines (running + waiting), by role",
                             ["role"], registry=r)
        self.state_total = Gauge("rackserve_state_bytes_total", "State memory, by role", ["role"], registry=r)
        self.balancedness = Gauge("rackserve_eplb_balancedness", "Expert load balancedness after the last EPLB "
                                  "re-placement (mean / max rank load), by instance", ["instance"], registry=r)
        self.kv = Gauge("rackserve_kv_transfers", "KV transfer counters summed over ranks, by kind", ["kind"],
                        registry=r)
        self.recovery = Gauge("rackserve_recovery", "Faults and their mending: push_failure_rate and "
                              "recompute_rate over the last minute, kv_stores_dead, kv_stores_replaced, "
                              "gangs_restarting", ["kind"], registry=r)
        self.store = Gauge("rackserve_kv_store", "KV stores summed, by tier (host memory, disk) and kind: "
                           "lookup_tokens, hit_tokens (hit rate = hit_tokens / lookup_tokens), evictions, "
                           "bytes_in_use, bytes_total; disk only: spills, dropped, read_errors, degraded (stores)",
                           ["tier", "kind"], registry=r)
        self.replays = Gauge("rackserve_replayed_requests", "Requests replayed after their decode gang failed, "
                             "by this replica (a running total)", registry=r)

    def observe_deployment(self, stats: dict) -> None:
        """Refresh the deployment-wide gauges from `Deployment.stats()`."""
        kv: dict[str, float] = {}
        for role in ("prefill", "decode"):
            used = cached = total = running = 0
            for inst in stats[role]:
                for member in inst["members"]:
                    used += member.get("state_bytes_in_use", 0)
                    cached += member.get("state_bytes_cached", 0)
                    total += member.get("state_bytes_total", 0)
                    running += member.get("running", 0) + member.get("waiting", 0)
                    for key, value in member.items():
                        if key.startswith("kv_"):
                            kv[key[3:]] = kv.get(key[3:], 0) + value
                history = inst["members"][0].get("eplb_balancedness")
                if history:
                    self.balancedness.labels(inst["name"]).set(history[-1][1])
            self.state_bytes.labels(role).set(used - cached)
            self.cached_bytes.labels(role).set(cached)
            self.running.labels(role).set(running)
            self.state_total.labels(role).set(total)
        for kind, value in kv.items():
            self.kv.labels(kind).set(value)
        for kind, value in stats.get("recovery", {}).items():
            self.recovery.labels(kind).set(value)
        for tier, values in store_tiers([s for s in stats.get("kv_stores", []) if s]).items():
            for kind, value in values.items():
                self.store.labels(tier, kind).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def store_tiers(stores: list[dict]) -> dict[str, dict[str, float]]:
    """The KV stores' stats (`KVStore.stats`) summed per tier: a hit's tokens count in the tier its
    blocks were read from (a lookup that reads blocks back from disk counts them there)."""
    def total(key: str) -> float:
        return sum(s.get(key, 0) for s in stores)

    disk_hits = total("disk_hit_tokens")
    tiers = {"host": {"lookup_tokens": total("lookup_tokens"), "hit_tokens": total("hit_tokens") - disk_hits,
                      "evictions": total("evictions"), "bytes_in_use": total("bytes_in_use"),
                      "bytes_total": total("bytes_total")}}
    if any("disk_bytes_total" in s for s in stores):
        tiers["disk"] = {"lookup_tokens": total("lookup_tokens"), "hit_tokens": disk_hits,
                         **{k: total(f"disk_{k}") for k in ("evictions", "bytes_in_use", "bytes_total", "spills",
                                                            "dropped", "read_errors", "degraded")}}
    return tiers
