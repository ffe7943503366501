"""Benchmarks: `adaspec bench` (offline, cluster.bench.offline) and `adaspec bench-serve`
(an HTTP load sweep, cluster.bench.serving)."""
