"""Sampling: per-request parameters and the batched sampler."""
