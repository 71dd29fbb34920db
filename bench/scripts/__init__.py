"""Standalone scripts, not subcommands: gpu_check.py (the engine on one CUDA device, docs/GPU.md)."""
