"""Instruments: Prometheus series (metrics.py, the one place server records become series), device and
process memory (memory.py) and the pre-load memory check, the feedback store and request records, the
connection layer's series. Imports server.http, server.prompt and server.config only."""
