"""LoRA adapters (PEFT's format) served on top of one base model, mixed per row in one batch.

`registry` (names, residency, LRU; plain Python), `shapes` (the base model's targetable projections,
torch-free), `adapter` (read and validate a PEFT folder into fused per-layer A/B), `loading` (the
registry of a torch engine: adapters read against its base model, placed on its device), `batch` (a
step's rows by adapter and the delta they add inside the linears), `triton_lora` (that delta on a GPU).
The settings are engine/config/lora.py's, the typed refusals engine/api/errors.py's.
"""
