"""Benchmarks of several replicas: router (replicas behind vllm-router, launched by launcher.py) and
fleet-sim (the router policies at scale, simulated)."""
