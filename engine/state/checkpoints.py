"""State checkpoints of a hybrid model: which checkpoint slot holds the state of which prefix. Plain
Python, no torch (the scheduler keeps it; engine/state/checkpoint_store.py holds the tensors and copies).

A recurrent state cannot be cut at an arbitrary prefix the way paged KV can: a hybrid model reuses a
prefix only where a copy of the whole state was taken. A checkpoint is one state slot's rows of every
state tensor, copied at a block-aligned position P of a sequence, and is keyed like the prefix cache's
blocks: by the chained hash of the prefix's last block (engine/kv/block_manager.py chain_hash), so a
later request finds it with the very hashes that find its KV blocks. A hit is confirmed by comparing
the P token ids, so a hash collision can never serve a wrong state.

Slots: `num_slots`, each free, registered (findable by hash) or both, and held or not by one running
request (`Request.checkpoint_slot`, written only here): the slot that request's state is copied into at
its next checkpoint position. A slot no request holds sits in an LRU (evicted first: unregistered slots,
then the least recently saved or hit). Taking a slot from the LRU evicts what it held. A held slot stays
registered under its last position until it is saved again (the copies of a step are ordered so that a
load from it in the same step reads the old state: engine/runner/model_runner.py).

Where checkpoints are taken (engine/sched/scheduler.py): at P* = the last block boundary of a request's
known tokens (floor(num_tokens / block_size) * block_size). A prompt chunk that would run past P* is cut
there, so the state at P* exists at the end of a step; a decode step reaches each boundary on its own.
The prompt's P* is registered and let go at once (a prompt sent again, a retry); every boundary its
answer reaches overwrites the one slot it then holds, so when it finishes, the end of prompt + answer
aligned down to a block boundary is registered: the prefix the next turn of a chat starts with.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.request import Request


@dataclass(eq=False)
class _Entry:
    block_hash: int | None = None  # the chained hash of the prefix's last block; None: unregistered
    tokens: tuple[int, ...] = field(default_factory=tuple)  # the prefix [0, P) (compared on a hit)


class CheckpointIndex:
    def __init__(self, num_slots: int, block_size: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a checkpoint index needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.block_size = block_size
        self._entries = [_Entry() for _ in range(num_slots)]
        self._by_hash: dict[int, int] = {}  # block hash -> slot
        self._lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_slots))  # first: evicted first
        self.saves = 0  # checkpoints registered (cumulative)
        self.evictions = 0  # registered checkpoints dropped to make room (cumulative)
        self.hits = 0  # requests started from a checkpoint (cumulative)
        self.hit_tokens = 0  # prompt tokens they skipped (cumulative)

    # ---- queries --------------------------------------------------------------------------------------
    @property
    def num_registered(self) -> int:
        return len(self._by_hash)

    @property
    def num_held(self) -> int:
        return self.num_slots - len(self._lru)

    def longest(self, request: Request, hashes: list[int]) -> tuple[int, int | None]:
        """(k, slot): the longest k <= len(hashes) whose prefix of k blocks has a checkpoint (its slot),
        where hashes[i] is the chained hash of the request's blocks 0..i (those the KV cache holds); (0,
        None) when none has. A hit becomes the most recently used."""
        for k in range(len(hashes), 0, -1):
            slot = self._by_hash.get(hashes[k - 1])
            if slot is None or self._entries[slot].tokens != tuple(request.tokens(0, k * self.block_size)):
                continue
            if slot in self._lru:
                self._lru.move_to_end(slot)
            return k, slot
        return 0, None

    def count_hit(self, tokens: int) -> None:
        self.hits += 1
        self.hit_tokens += tokens

    # ---- slots ----------------------------------------------------------------------------------------
    def take(self, request: Request) -> int | None:
        """The slot the request's state is copied into at this step's end: the one it holds, else the
        LRU's first (what it held is evicted); None when every slot is held (no checkpoint this time)."""
        if request.checkpoint_slot is not None:
            return request.checkpoint_slot
        if not self._lru:
            return None
        slot, _ = self._lru.popitem(last=False)
        if self._unregister(slot):
            self.evictions += 1
        request.checkpoint_slot = slot
        return slot

    def register(self, request: Request, block_hash: int, tokens: tuple[int, ...]) -> None:
        """After the step that copied the request's state into its slot: that slot now holds the state
        of prefix `tokens` (block-aligned), findable by `block_hash`. A checkpoint of the same prefix in
        another slot is dropped (the newest copy wins)."""
        slot = request.checkpoint_slot
        if slot is None:
            raise RuntimeError(f"request {request.request_id!r} registers a checkpoint without a slot")
        if len(tokens) % self.block_size or not tokens:
            raise ValueError(f"a checkpoint covers whole blocks, got {len(tokens)} tokens")
        self._unregister(slot)
        other = self._by_hash.get(block_hash)
        if other is not None:
            self._unregister(other)
        self._entries[slot] = _Entry(block_hash, tokens)
        self._by_hash[block_hash] = slot
        self.saves += 1

    def release(self, request: Request, keep: bool = True) -> None:
        """Let go of the request's slot (nothing when it holds none). keep: it stays findable (the last
        save of a step that ran completed); False: it is dropped (a failed step may have half-written it)."""
        slot = request.checkpoint_slot
        if slot is None:
            return
        request.checkpoint_slot = None
        if not keep:
            self._unregister(slot)
        self._lru[slot] = None
        if self._entries[slot].block_hash is None:
            self._lru.move_to_end(slot, last=False)  # nothing to keep: reused first

    def _unregister(self, slot: int) -> bool:
        entry = self._entries[slot]
        if entry.block_hash is None:
            return False
        if self._by_hash.get(entry.block_hash) == slot:
            del self._by_hash[entry.block_hash]
        self._entries[slot] = _Entry()
        return True

    # ---- invariants -----------------------------------------------------------------------------------
    def check_integrity(self, requests: Iterable[Request]) -> None:
        """RuntimeError unless every slot is either in the LRU or held by exactly one of the live
        `requests`, and every hash points to a slot registered under it."""
        held = [r.checkpoint_slot for r in requests if r.checkpoint_slot is not None]
        if len(set(held)) != len(held):
            raise RuntimeError(f"a checkpoint slot is held twice: {sorted(held)}")
        if set(held) & set(self._lru) or len(held) + len(self._lru) != self.num_slots:
            raise RuntimeError(f"checkpoint slots: {len(held)} held + {len(self._lru)} in the LRU != {self.num_slots}")
        for h, slot in self._by_hash.items():
            entry = self._entries[slot]
            if entry.block_hash != h or len(entry.tokens) % self.block_size or not entry.tokens:
                raise RuntimeError(f"checkpoint hash points to slot {slot}, which holds another prefix")
        registered = sum(1 for e in self._entries if e.block_hash is not None)
        if registered != len(self._by_hash):
            raise RuntimeError(f"{registered} checkpoint slots registered, {len(self._by_hash)} findable")
