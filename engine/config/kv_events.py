"""KV-cache events configuration, as vLLM spells it (`--kv-events-config '<json>'`).

Same fields, defaults and meaning as vLLM's `vllm/config/kv_events.py` `KVEventsConfig`, plus
`encoding` (the event layout, for consumers of older vLLM releases); a JSON object with any other key,
or a value of the wrong type, is refused with the key's name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("null", "zmq")
ENCODINGS = ("map", "array")  # engine/kv/events_zmq.py


@dataclass(frozen=True)
class KVEventsConfig:
    """Whether and where the engine publishes its prefix-cache changes (docs/DEPLOY.md, "KV-cache events")."""

    enable_kv_cache_events: bool = False  # False: no events are recorded at all
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when events are enabled, else "null"
    endpoint: str = "tcp://*:5557"  # PUB socket: bound when it has "*", "::", ipc:// or inproc://, else connected
    replay_endpoint: str | None = None  # ROUTER socket (always bound) answering replay requests; None: no replay
    buffer_steps: int = 10_000  # batches (one per engine step) kept for replay
    hwm: int = 100_000  # ZMQ high-water mark of the PUB socket (messages per subscriber before ZMQ drops)
    max_queue_size: int = 100_000  # batches waiting for the sender thread; a step's batch past this is dropped
    topic: str = ""  # first frame of every published message (subscribers filter on its prefix)
    # tokenmill's own key: how events are laid out. "map": vLLM's current layout, each event a map tagged
    # by "type" (what vllm-router 0.1.17 decodes); "array": the positional layout of vLLM releases whose
    # events were msgspec array_like (older consumers, llm-d's positional decoder)
    encoding: str = "map"

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"enable_kv_cache_events must be a bool, got {self.enable_kv_cache_events!r}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"publisher must be one of {PUBLISHERS}, got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if not self.endpoint:
            raise ValueError("endpoint must be a non-empty ZMQ address, e.g. tcp://*:5557")
        if self.replay_endpoint is not None and (not isinstance(self.replay_endpoint, str) or not self.replay_endpoint):
            raise ValueError(f"replay_endpoint must be a ZMQ address or null, got {self.replay_endpoint!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def publishes(self) -> bool:
        """True when events are recorded and sent somewhere (enabled with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVEventsConfig:
        """From vLLM's JSON keys. Raises ValueError naming an unknown key or a bad value."""
        if not isinstance(data, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"kv_events_config.{exc}") from None

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """From the flag's JSON text. Raises ValueError (bad JSON names the position)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_events_config is not valid JSON: {exc}") from None
        return cls.from_dict(data)
