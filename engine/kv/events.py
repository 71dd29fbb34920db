"""KV-cache events: what the prefix cache gained and lost, as typed records, and where they go.

The block manager records one event whenever its set of findable blocks changes (a full computed block
registered under its hash, a registered block evicted for reuse, the whole cache reset); the engine
hands each step's records to a `KVEventSink` in one call. The records mirror vLLM's
`vllm/distributed/kv_events.py` classes field for field, so a publisher can put them on the wire in
vLLM's format (engine/kv/events_zmq.py); nothing here knows about sockets or encodings.

Block hashes leave the engine as unsigned 64-bit integers (`external_hash`): the block manager's
`hash()` values are signed, and consumers (vllm-router) reject negative hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

MEDIUM_GPU = "GPU"  # vLLM's name for the tier the model computes from (tokenmill's only tier, CPU or CUDA)
_U64 = (1 << 64) - 1


def external_hash(block_hash: int, salt: int = 0) -> int:
    """The block manager's hash as published: its two's-complement bits XOR the engine's salt, as an
    unsigned 64-bit int. A bijection on hash() values (distinct cached hashes stay distinct); the salt
    keeps two engines of one process (model versions during a rollout) from publishing the same hash
    for the same tokens, so one's removals never cancel the other's blocks at a consumer."""
    return (block_hash ^ salt) & _U64


@dataclass(frozen=True)
class BlockStored:
    """Consecutive blocks of one sequence became findable in the prefix cache."""

    block_hashes: list[int]  # external hashes, in sequence order
    parent_block_hash: int | None  # external hash of the block before the first one; None: the sequence's start
    token_ids: list[int]  # the blocks' tokens, concatenated: len == block_size * len(block_hashes)
    block_size: int
    lora_id: int | None = None  # the adapter the blocks were computed under (its load id); None: the base model
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks stopped being findable (evicted: their memory is reused for other tokens)."""

    block_hashes: list[int]  # external hashes
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True)
class AllBlocksCleared:
    """Nothing published before by this worker is cached any more (a reset, a new engine)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventsStats:
    """A publisher's counters since it started (cumulative), read by the server's metrics."""

    batches_published: int = 0  # batches handed to the transport (sequence numbers given out)
    events_published: int = 0
    batches_dropped: int = 0  # batches refused because the queue was full (the engine did not wait)
    events_dropped: int = 0
    queue_size: int = 0  # batches waiting for the sender thread now
    replay_requests: int = 0  # replay requests answered


class KVEventSink(Protocol):
    """Where the engine puts each step's events. Called on the engine's thread, so it must not block:
    an implementation that cannot take a batch now drops it and says so."""

    def publish(self, events: Sequence[KVCacheEvent]) -> bool:
        """Take one step's events, in order. False: the batch was dropped (the engine then re-announces
        its whole cache, engine/core/step_loop.py), True: it will be delivered (as far as the transport does)."""
        ...

    def has_room(self) -> bool:
        """Whether a batch published now would be taken (cheap; the engine checks it before building
        a whole-cache batch, so a stuck consumer never makes every step pay for one)."""
        ...

    def stats(self) -> KVEventsStats:
        """A snapshot of the counters (safe to call from any thread)."""
        ...

    def close(self) -> None:
        """Stop delivering; pending batches get a short grace period to go out."""
        ...
