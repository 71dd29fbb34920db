"""Why an adapter was refused, typed, so the server answers 4xx naming the problem without parsing
text. Every one is an `InvalidParam` (a ValueError); `status` is the HTTP status the server uses."""

from __future__ import annotations

from engine.errors import InvalidParam


class LoraError(InvalidParam):
    """An adapter the engine refuses. `field`: the caller's field at fault (lora_path, lora_name, model)."""

    status = 400
    kind = "invalid_lora"


class LoraFilesMissing(LoraError):
    """The path is not a folder with adapter_config.json and adapter_model.safetensors."""

    status = 404
    kind = "lora_not_found"


class LoraBadConfig(LoraError):
    """adapter_config.json is not JSON, or not a LoRA config, or asks for what we do not run (DoRA, bias)."""


class LoraUnsupportedTarget(LoraError):
    """A target module outside q/k/v/o/gate/up/down projections (embeddings, lm_head, ...)."""


class LoraShapeError(LoraError):
    """A tensor's shape disagrees with the adapter itself (A and B ranks, missing halves)."""


class LoraBaseMismatch(LoraError):
    """The adapter was made for another base model: layer count or projection sizes differ."""


class LoraRankTooHigh(LoraError):
    """A module's rank exceeds max_lora_rank."""


class LoraNameTaken(LoraError):
    """An adapter of that name is loaded already (or the name is the base model's)."""

    status = 409
    kind = "lora_exists"


class LoraUnknown(LoraError):
    """No adapter of that name is loaded."""

    status = 404
    kind = "lora_not_found"


class LoraCapacity(LoraError):
    """max_cpu_loras adapters are registered already: unload one first."""

    status = 409
    kind = "lora_capacity"
