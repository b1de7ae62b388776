"""Benchmarks of the elastic server, run as modules (`python -m coordinator.bench.scaling`).

`loadgen` is the reusable HTTP load client (seeded Poisson arrivals, streamed
completions, per-token timings); `scale_metrics` holds the pure figures computed
from its records; `scaling` is the scale-event benchmark (ElasticMoE §7.4-7.7).
"""
