"""The engine's errors for bad input, typed so a caller (the HTTP server) reports them without parsing
message text: `InvalidParam` names the field; the `LoraError` family says why an adapter was refused
(each an `InvalidParam`, `status` the HTTP status the server uses). Torch-free."""

from __future__ import annotations


class InvalidParam(ValueError):
    """A request or config value the engine refuses. `field` is the name as the caller gave it
    (`max_tokens`, `prompt_token_ids`, `temperature`, ...); `message` says why, naming the limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


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
