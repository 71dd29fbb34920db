"""Benchmarks of the engine in this process, no HTTP: offline, floor, quality, gemv, fused, lora, spec,
linear-ab, determinism, startup (model load in fresh interpreters, then server start-up)."""
