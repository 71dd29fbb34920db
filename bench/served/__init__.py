"""Benchmarks of a served `python -m server` over HTTP: load, sweep, priority, long-prompt, spec-http,
structured, swap, contention."""
