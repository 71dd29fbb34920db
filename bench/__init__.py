"""Benchmarks of tokenmill against baselines: `python -m bench <subcommand>` (or `tokenmill bench`).

Packages, each importing only those listed before it (tests/bench/test_bench_layering.py):
- lib/: what the benchmarks share, importing no benchmark: the HTTP load client, the server launcher
  and its readiness wait, statistics, workloads, machine facts, Prometheus scrapes.
- inproc/ (the engine in this process), served/ (a `python -m server` over HTTP), fleet/ (replicas
  behind a router), report/ (the benchmarks page from result records): the subcommands, none
  importing another's.
- scripts/: standalone scripts (gpu_check.py); peers/: the side-by-side shell scripts (compare.sh,
  lora_peers.sh, spec_peers.sh); data/: files the benchmarks read.
cli.py registers every subcommand; __main__.py runs it.
"""
