"""Benchmarks: workloads, sweeps and micro-benchmarks against what users would otherwise use."""
