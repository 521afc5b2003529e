"""The KV-transfer benchmark runs end to end on the shared test cluster (1 MiB, one round)."""

from __future__ import annotations

from rackserve.bench.kv_transfer import main


def test_kv_transfer_bench_reports_all_three_ways(ray_cluster):
    result = main(["--sizes", "1", "--repeats", "1"])
    for way in ("nixl", "objstore", "memcpy"):
        assert result[f"{way}_1mb_gbps"] > 0
    for model in ("tiny", "v4flash_bf16", "v4flash_fp32"):
        assert result[f"{model}_bytes_per_token"] > 0
