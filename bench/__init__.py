"""Benchmarks: offline throughput, serving, load test, block manager."""
