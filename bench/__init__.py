"""Benchmarks of tokenmill against baselines: `python -m bench <subcommand>` (or `tokenmill bench`)."""
