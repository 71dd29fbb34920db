"""The engine's settings, frozen and validated, torch-free (the server builds them from its own
settings): `EngineConfig` and the option groups it holds (`LoraConfig`, `SpeculativeConfig`), the KV
events' `KVEventsConfig`, and the default engine thread count from the CPUs this process may use."""

from __future__ import annotations

from engine.config.engine_config import EngineConfig
from engine.config.kv_events import KVEventsConfig
from engine.config.lora import LoraConfig
from engine.config.speculative import SpeculativeConfig
from engine.config.threads import default_engine_threads

__all__ = ["EngineConfig", "KVEventsConfig", "LoraConfig", "SpeculativeConfig", "default_engine_threads"]
