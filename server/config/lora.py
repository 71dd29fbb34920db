"""`--lora-modules` values as vLLM spells them: `name=path`, or a JSON object
`{"name": ..., "path": ..., "base_model_name": ...}` (base_model_name is accepted and ignored: an
adapter serves the model it was loaded on). A string from the environment may hold several, space- or
comma-separated."""

from __future__ import annotations

import json
from typing import Any


def parse_lora_modules(value: Any) -> list[tuple[str, str]]:
    """(name, path) pairs from a list of entries or one string. Raises ValueError naming the entry."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value] if value.lstrip().startswith("{") else value.replace(",", " ").split()
    if not isinstance(value, (list, tuple)):
        raise ValueError("lora_modules: give a list of name=path entries")
    return [_entry(item) for item in value]


def _entry(item: Any) -> tuple[str, str]:
    if isinstance(item, (list, tuple)) and len(item) == 2:
        name, path = item
    elif isinstance(item, dict):
        name, path = item.get("name"), item.get("path")
    elif isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            obj = json.loads(item)
        except ValueError:
            raise ValueError(f"lora_modules: {item!r} is not valid JSON") from None
        return _entry(obj if isinstance(obj, dict) else None)
    elif isinstance(item, str) and "=" in item:
        name, path = item.split("=", 1)
    else:
        raise ValueError(f"lora_modules: {item!r} is not name=path or a JSON object with name and path")
    if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
        raise ValueError(f"lora_modules: {item!r} needs a non-empty name and path")
    return name.strip(), path.strip()
