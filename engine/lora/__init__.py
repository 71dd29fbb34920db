"""LoRA adapters (PEFT's format) served on top of one base model, mixed per row in one batch.

Torch-free at this level, so the server may import the errors and the config: `errors` (typed
refusals), `config` (LoraConfig), `registry` (names, residency, LRU). The torch side: `adapter`
(read and validate a PEFT folder into fused per-layer A/B), `batch` (a step's rows by adapter and
the delta they add inside the linears).
"""
