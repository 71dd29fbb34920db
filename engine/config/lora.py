"""LoRA settings of one engine: frozen, validated, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoraConfig:
    """Adapters on. Memory per adapter: see docs/ENGINE.md ("LoRA adapters")."""

    max_loras: int = 4  # distinct adapters in one step (resident in the model's dtype and device), LRU
    max_lora_rank: int = 16  # an adapter whose rank is higher is refused
    # adapters registered at once (host copies, validated); each is bounded by max_lora_rank, so this
    # bounds the memory clients can make the server hold through the load endpoint
    max_cpu_loras: int = 64
    # (name, path) loaded at start-up, in order
    modules: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        object.__setattr__(self, "modules", tuple((str(n), str(p)) for n, p in self.modules))
        names = [n for n, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora modules: a name is given twice: {names}")
        if len(names) > self.max_cpu_loras:
            raise ValueError(f"lora modules: {len(names)} adapters exceed max_cpu_loras ({self.max_cpu_loras})")
