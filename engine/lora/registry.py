"""Adapters by name, and which are resident (on the model's device, in its dtype), in plain Python.

Registered adapters are validated host copies (at most `max_cpu_loras`); a step may use at most
`max_loras` distinct adapters (the scheduler holds a request back otherwise), whose device copies are
kept in an LRU of that size: one not resident is copied in when a step needs it (its cost is counted
in `LoraStats`), evicting the least recently used. On the CPU in float32 the copy is the host tensors.

Unloading lets requests in flight finish: the name goes at once (new requests get 404), the weights
when no live request uses them (`collect`, after every step).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from engine.api.errors import LoraCapacity, LoraError, LoraNameTaken, LoraUnknown
from engine.api.outputs import LoraInfo
from engine.config.lora import LoraConfig


@dataclass
class LoraStats:
    """Cumulative residency counters."""

    loads: int = 0  # device copies made (a miss of the resident LRU)
    load_s: float = 0.0  # seconds those took
    evictions: int = 0


@dataclass
class _Entry:
    info: LoraInfo
    adapter: Any  # engine.lora.adapter.LoraAdapter (opaque here)


class LoraRegistry:
    """`read(name, path)` validates a folder into an adapter (raises LoraError); `place(adapter)` makes
    its device copy. Both come from the torch engine, so this class stays plain Python (and testable)."""

    def __init__(self, config: LoraConfig, read: Callable[[str, str], Any], place: Callable[[Any], Any],
                 clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        self.config = config
        self._read = read
        self._place = place
        self._clock = clock
        self._by_name: dict[str, _Entry] = {}
        self._retired: dict[int, _Entry] = {}  # unloaded while requests used them
        self._resident: OrderedDict[int, Any] = OrderedDict()  # lora_id -> device copy; first = LRU
        self._next_id = 1
        self.stats = LoraStats()

    # ---- names ------------------------------------------------------------------------------------
    def add(self, name: str, path: str) -> LoraInfo:
        """Read, validate and register an adapter. Raises LoraError; on error nothing is registered."""
        if not isinstance(name, str) or not name.strip():
            raise LoraError("lora_name", "lora_name must be a non-empty string")
        if name in self._by_name:
            raise LoraNameTaken("lora_name", f"an adapter named {name!r} is already loaded")
        if len(self._by_name) + len(self._retired) >= self.config.max_cpu_loras:
            raise LoraCapacity("lora_name", f"{self.config.max_cpu_loras} adapters are loaded (max_cpu_loras); "
                               "unload one first")  # fmt: skip
        adapter = self._read(name, path)
        info = LoraInfo(name, self._next_id, str(path), adapter.rank, tuple(adapter.targets), adapter.nbytes)
        self._next_id += 1
        self._by_name[name] = _Entry(info, adapter)
        return info

    def remove(self, name: str) -> LoraInfo:
        """Forget the name now; its weights stay until no live request uses them (collect)."""
        entry = self._by_name.pop(name, None)
        if entry is None:
            raise LoraUnknown("lora_name", f"no adapter named {name!r} is loaded")
        self._retired[entry.info.lora_id] = entry
        return entry.info

    def resolve(self, name: str) -> int:
        """The lora_id a request naming `name` runs on. Raises LoraUnknown (field `model`)."""
        entry = self._by_name.get(name)
        if entry is None:
            raise LoraUnknown("model", f"no adapter named {name!r} is loaded; adapters: {sorted(self._by_name)}")
        return entry.info.lora_id

    def infos(self) -> list[LoraInfo]:
        return [e.info for e in self._by_name.values()]

    def collect(self, live_ids: Iterable[int]) -> None:
        """Drop retired adapters no live request uses (call after a step, with every live request's id)."""
        if not self._retired:
            return
        live = set(live_ids)
        for lora_id in [i for i in self._retired if i not in live]:
            del self._retired[lora_id]
            self._resident.pop(lora_id, None)

    # ---- residency ------------------------------------------------------------------------------------
    def resident(self, lora_id: int) -> Any:
        """The device copy of adapter `lora_id`, made now if it is not resident (LRU of max_loras)."""
        copy = self._resident.get(lora_id)
        if copy is not None:
            self._resident.move_to_end(lora_id)
            return copy
        entry = next((e for e in self._by_name.values() if e.info.lora_id == lora_id), None) \
            or self._retired.get(lora_id)  # fmt: skip
        if entry is None:
            raise KeyError(f"lora_id {lora_id} is not registered")
        while len(self._resident) >= self.config.max_loras:
            self._resident.popitem(last=False)
            self.stats.evictions += 1
        t0 = self._clock()
        copy = self._resident[lora_id] = self._place(entry.adapter)
        self.stats.loads += 1
        self.stats.load_s += self._clock() - t0
        return copy

    @property
    def num_resident(self) -> int:
        return len(self._resident)
