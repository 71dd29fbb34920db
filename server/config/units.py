"""Human-readable sizes in settings and bodies: bytes (`512MiB`, `2GB`) and token counts (vLLM's `4k`,
`4K`)."""

from __future__ import annotations

import re
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgKMG])\s*$")


def parse_token_count(value: Any) -> Any:
    """vLLM's human-readable lengths: `4k` = 4000, `4K` = 4096 (lowercase decimal, uppercase binary);
    anything else passes through."""
    match = _COUNT.match(value) if isinstance(value, str) else None
    if not match:
        return value
    unit = match.group(2)
    scale = (1000 if unit.islower() else 1024) ** ("kmg".index(unit.lower()) + 1)
    return int(float(match.group(1)) * scale)


def parse_size(value: Any) -> Any:
    """Bytes from `1073741824`, `"512MiB"` or `"2GB"`; anything but a string passes through."""
    if not isinstance(value, str):
        return value
    match = _SIZE.match(value)
    if not match:
        raise ValueError(f"expected bytes like 1073741824, 512MiB or 2GB, got {value!r}")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    base = 1024 if "i" in unit else 1000
    scale = _UNITS[unit[:1]] if base == 1000 else base ** "bkmgt".index(unit[:1])
    return int(number * scale)
