"""Paged KV-cache bookkeeping in plain Python: ref-counted blocks, a free list, prefix caching.

A block holds `block_size` consecutive tokens of one or more requests (shared through the prefix
cache). A *full* block whose K/V are computed is registered under a chained hash
hash(parent_hash, its token ids) (the first block's parent salts it by LoRA adapter: `root_hash`, and
for a LongRoPE model by whether the request is longer than the switch: such a request's tokens are
all turned with the long factors, engine/models/rope.py); a later request on the same adapter (and,
LongRoPE, the same side of the switch) whose prompt starts with the same tokens reuses it.
Free blocks that still hold a registered prefix stay findable until they are evicted; eviction
takes the least recently freed block first.

With `record_events`, every change to the set of findable blocks is recorded as a KV-cache event
(engine/kv/events.py): registered -> BlockStored, evicted -> BlockRemoved, reset -> AllBlocksCleared;
the engine takes them once per step (`take_events`). Replaying them in order rebuilds exactly
`cached_hashes()`.

Sliding windows (`sliding_window`: the window of every layer whose blocks this manager keeps: Mistral's
one group, or a sliding group of a model mixing sliding and full layers, engine/kv/groups.py): once a
request's computed tokens reach past a block by the whole window, no later query reads it, so
`release_out_of_window` frees it. Its entry in the block table stays, as NULL_BLOCK, so positions keep
their blocks; `num_freed_blocks` counts these leading placeholders. A freed block is handed back like a
finished request's: one that holds a registered prefix stays findable until evicted (its K/V are
unchanged until then, so a hit on it is exact), then the chain of hits stops there as for any evicted
block. A manager of group g > 0 keeps its tables in request.kv_groups[g - 1] (`table`), group 0 in the
Request's own fields.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, external_hash
from engine.request import GroupTable, Request


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full, computed and registered
    token_ids: tuple[int, ...] = field(default_factory=tuple)  # compared on a hash hit
    parent_hash: int | None = None  # hash of the block before it in its sequence (KV events name it)
    # the adapter its K/V were computed under (0: the base model); KV events carry it, and a first
    # block's parent_hash is then its adapter's salt (root_hash), which KV events publish as no parent
    lora_id: int = 0


# What a freed out-of-window block leaves in its request's block table: a block id every kernel can index
# but none reads for that sequence (engine/attention/base.py: no key before the window is read; the
# reference reads it under a -inf mask, and the cache holds finite values everywhere).
NULL_BLOCK = 0


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def root_hash(request: Request, rope_switch: int | None = None) -> int | None:
    """The parent of a request's first block: None on the base model, a salt per LoRA adapter, so a
    block computed under one adapter (its K/V differ) never serves another or the base model. With a
    LongRoPE switch, a request longer than it salts that again (its K/V below the switch differ; a
    request that grows past the switch is computed again from its first token, under this root)."""
    root = None if request.lora_id == 0 else lora_root(request.lora_id)
    if rope_switch is not None and request.num_tokens > rope_switch:
        return long_rope_root(root)
    return root


def lora_root(lora_id: int) -> int:
    return hash(("lora", lora_id))


def long_rope_root(root: int | None) -> int:
    return hash(("longrope", root))


def is_root(parent: int | None, lora_id: int) -> bool:
    """Whether `parent` is a first block's parent (a salt no block has), not a block's hash."""
    root = None if lora_id == 0 else lora_root(lora_id)
    return parent == root or parent == long_rope_root(root)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
        event_hash_salt: int = 0,
        sliding_window: int | None = None,
        rope_switch: int | None = None,
        group: int = 0,
    ) -> None:
        """`record_events`: keep KV events for take_events(); `event_hash_salt`: mixed into the hashes
        they carry (engine/kv/events.py external_hash); `sliding_window`: the window of a model whose
        every layer has it (blocks that left it are freed, release_out_of_window), None otherwise;
        `rope_switch`: a LongRoPE model's switch position (root_hash), None otherwise; `group`: the KV-cache
        group whose block tables it keeps (engine/kv/groups.py): 0 the Request's own fields, g > 0
        request.kv_groups[g - 1]."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # LRU of free blocks: first = evicted first. Values unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up (cumulative)
        self.prefix_hits = 0  # prompt tokens found (cumulative)
        # KV events since the last take_events(), in order; None: not recorded (no cost)
        self._events: list[KVCacheEvent] | None = [] if record_events else None
        self._salt = event_hash_salt
        self.sliding_window = sliding_window
        self.rope_switch = rope_switch
        self.group = group

    def table(self, request: Request) -> Request | GroupTable:
        """The request's block table in this manager's group (created empty on first use)."""
        if self.group == 0:
            return request
        tables = request.kv_groups
        while len(tables) < self.group:
            tables.append(GroupTable())
        return tables[self.group - 1]

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so that request can hold num_computed + num_new_tokens tokens."""
        t = self.table(request)
        total = request.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(t.block_ids))

    # ---- prefix cache ----------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request's tokens (not yet acquired).

        At most num_tokens - 1 tokens are matched: the last token must be computed to get logits.
        """
        return self.find_cached_chain(request)[0]

    def find_cached_chain(self, request: Request) -> tuple[list[int], list[int]]:
        """find_cached_prefix's block ids, and the chained hash of each (hashes[i]: blocks 0..i; a hybrid
        model's state checkpoints are keyed by them, engine/state/checkpoints.py)."""
        if not self.enable_prefix_caching:
            return [], []
        hits: list[int] = []
        hashes: list[int] = []
        parent = root_hash(request, self.rope_switch)
        max_blocks = (request.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            tokens = tuple(request.tokens(i * self.block_size, (i + 1) * self.block_size))
            h = chain_hash(parent, tokens)
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            hashes.append(h)
            parent = h
        return hits, hashes

    def acquire_cached_prefix(self, request: Request, block_ids: list[int], first: int = 0,
                              last_hash: int | None = None) -> None:
        """Give the request the cached blocks (from find_cached_prefix) and count the lookup.

        A sliding group's hit (engine/kv/groups.py) holds only the blocks its window still reads: block_ids
        are blocks first.. of the prefix, the `first` before them stand as NULL_BLOCK (freed, as if they
        had left the window), and last_hash is the chained hash of the prefix's last block."""
        t = self.table(request)
        assert not t.block_ids and (self.group or request.num_computed_tokens == 0)
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        t.block_ids = [NULL_BLOCK] * first + list(block_ids)
        t.num_freed_blocks = first
        t.num_hashed_blocks = len(t.block_ids)
        t.last_block_hash = self.blocks[block_ids[-1]].block_hash if block_ids else last_hash
        if self.group:  # the request's counters are group 0's
            return
        request.num_computed_tokens = len(t.block_ids) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += request.num_computed_tokens

    def fits(self, request: Request, cached: list[int], num_new_tokens: int, first: int = 0) -> bool:
        """Whether a waiting request can take its cached prefix blocks (blocks first.. of its prefix,
        acquire_cached_prefix) plus blocks for num_new_tokens new tokens."""
        bs = self.block_size
        prefix = first + len(cached)
        new_blocks = -(-(prefix * bs + num_new_tokens) // bs) - prefix
        # Cached prefix blocks that sit in the free list stop being free once acquired.
        cached_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return new_blocks + cached_free <= len(self._free)

    def register_computed_blocks(self, request: Request) -> None:
        """Register every full block whose K/V are now computed, so later requests can share it."""
        t = self.table(request)
        if not self.enable_prefix_caching:
            return
        n_done = t.num_hashed_blocks
        n_full = min(request.num_computed_tokens // self.block_size, len(t.block_ids))
        parent = t.last_block_hash if n_done else root_hash(request, self.rope_switch)
        run: list[Block] = []  # consecutive blocks registered here: one BlockStored event
        for i in range(n_done, n_full):
            tokens = tuple(request.tokens(i * self.block_size, (i + 1) * self.block_size))
            h = chain_hash(parent, tokens)
            block = self.blocks[t.block_ids[i]]
            if block.block_hash is None and h not in self._cached:
                block.block_hash, block.token_ids, block.parent_hash = h, tokens, parent
                block.lora_id = request.lora_id
                self._cached[h] = block.block_id
                run.append(block)
            else:  # already cached (here or in another block): the run of new blocks ends
                self._record_stored(run)
                run = []
            parent = h
        self._record_stored(run)
        t.num_hashed_blocks = max(n_done, n_full)
        t.last_block_hash = parent

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Add blocks so the request can hold num_new_tokens more tokens. False (and no change)
        when there are not enough free blocks."""
        t = self.table(request)
        needed = self.blocks_needed(request, num_new_tokens)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            t.block_ids.append(self._take_free_block())
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks. Blocks go to the free list in reverse order, so the LRU
        evicts a sequence's tail before its head (heads are the likelier shared prefixes)."""
        t = self.table(request)
        for block_id in reversed(t.block_ids[t.num_freed_blocks :]):
            self._release(block_id)
        t.block_ids = []
        t.num_freed_blocks = 0
        t.num_hashed_blocks = 0
        t.last_block_hash = None
        if not self.group:  # the request's counters are group 0's
            request.num_computed_tokens = 0

    def release_out_of_window(self, request: Request) -> int:
        """Free the request's blocks that no query will read again (a sliding-window model, see the
        module docstring): the next query sits at position num_computed_tokens or later and sees back
        to sliding_window - 1 positions before it, so block i is done once (i + 1) * block_size <=
        num_computed_tokens - sliding_window + 1. With prefix caching only registered blocks go (the
        rest are registered first, by register_computed_blocks). Returns how many were freed now."""
        t = self.table(request)
        if self.sliding_window is None:
            return 0
        done = max(0, request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        if self.enable_prefix_caching:
            done = min(done, t.num_hashed_blocks)
        done = min(done, len(t.block_ids))
        start = t.num_freed_blocks
        for i in range(start, done):
            self._release(t.block_ids[i])
            t.block_ids[i] = NULL_BLOCK
        t.num_freed_blocks = max(start, done)
        return max(0, done - start)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)  # nothing to keep: reuse first

    def truncate(self, request: Request) -> None:
        """Free the blocks past the request's computed tokens (a rejected draft tail's). They were
        never full and computed, so none carries a prefix-cache hash; they are reused first."""
        t = self.table(request)
        keep = -(-request.num_computed_tokens // self.block_size)
        if keep < t.num_hashed_blocks:
            raise RuntimeError("truncate would drop blocks registered in the prefix cache")
        for block_id in reversed(t.block_ids[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)
        del t.block_ids[keep:]

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached prefix
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
                self._record_removed(block.block_hash)
            block.block_hash, block.token_ids, block.parent_hash, block.lora_id = None, (), None, 0
        block.ref_count = 1
        return block_id

    # ---- reset and KV events ----------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache). Only while no block is held by a
        request (their hashes could not be dropped consistently): False and no change otherwise."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash, block.token_ids, block.parent_hash, block.lora_id = None, (), None, 0
        self._cached.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def cached_hashes(self) -> set[int]:
        """The external hashes (engine/kv/events.py) of every block findable by hash now."""
        return {self._external(h) for h in self._cached}

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first ([] when not recording)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def snapshot_events(self) -> list[KVCacheEvent]:
        """AllBlocksCleared, then one BlockStored per cached block, each after its cached parent: replayed
        on any state they give exactly `cached_hashes()` (the engine's re-announce after a lost batch)."""
        events: list[KVCacheEvent] = [AllBlocksCleared()]
        depths = self._depths()
        for h in sorted(self._cached, key=depths.__getitem__):
            block = self.blocks[self._cached[h]]
            events.append(BlockStored([self._external(h)], self._event_parent(block), list(block.token_ids),
                                      self.block_size, lora_id=block.lora_id or None))  # fmt: skip
        return events

    def _depths(self) -> dict[int, int]:
        """Cached hash -> how many cached blocks precede it in its chain (iterative: chains are long)."""
        depth: dict[int, int] = {}
        for start in self._cached:
            chain = [start]  # walk up until a block whose depth is known or whose parent is not cached
            while chain[-1] not in depth and len(chain) <= len(self._cached):
                parent = self.blocks[self._cached[chain[-1]]].parent_hash
                if parent is None or parent not in self._cached:
                    depth[chain[-1]] = 0
                    break
                chain.append(parent)
            known = depth.get(chain[-1], 0)
            for i, h in enumerate(reversed(chain)):
                depth.setdefault(h, known + i)
        return depth

    def _record_stored(self, run: list[Block]) -> None:
        if self._events is None or not run:
            return
        self._events.append(BlockStored(
            block_hashes=[self._external(b.block_hash) for b in run if b.block_hash is not None],
            parent_block_hash=self._event_parent(run[0]),
            token_ids=[t for b in run for t in b.token_ids],
            block_size=self.block_size,
            lora_id=run[0].lora_id or None,
        ))  # fmt: skip

    def _event_parent(self, block: Block) -> int | None:
        """The parent a KV event names: none for a sequence's first block (the base model's parent is
        None, an adapter's or a long LongRoPE prompt's is its salt, which no event ever stored)."""
        parent = block.parent_hash
        if parent is None or is_root(parent, block.lora_id):
            return None
        return self._external(parent)

    def _record_removed(self, block_hash: int) -> None:
        if self._events is None:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):  # one event for the blocks a step evicts back to back
            last.block_hashes.append(self._external(block_hash))
        else:
            self._events.append(BlockRemoved([self._external(block_hash)]))

    def _external(self, block_hash: int) -> int:
        return external_hash(block_hash, self._salt)

    # ---- invariants ----------------------------------------------------------------------
    def check_integrity(self, requests: Iterable[Request] = ()) -> None:
        """Raise AssertionError-free RuntimeError if bookkeeping is inconsistent.

        free + used == total; a block is free iff its ref count is 0; ref counts equal the number
        of block tables (of the given live requests) holding the block; cached hashes point to
        blocks carrying that hash.
        """
        refs = [0] * self.num_blocks
        for req in requests:
            t = self.table(req)
            for block_id in t.block_ids[t.num_freed_blocks :]:
                refs[block_id] += 1
        for block in self.blocks:
            is_free = block.block_id in self._free
            if is_free != (block.ref_count == 0):
                raise RuntimeError(f"block {block.block_id}: free={is_free} but ref_count={block.ref_count}")
            if block.ref_count != refs[block.block_id]:
                raise RuntimeError(
                    f"block {block.block_id}: ref_count {block.ref_count} != {refs[block.block_id]} holders"
                )
        if len(self._free) + sum(1 for b in self.blocks if b.ref_count > 0) != self.num_blocks:
            raise RuntimeError("free + used != total")
        for h, block_id in self._cached.items():
            if self.blocks[block_id].block_hash != h:
                raise RuntimeError(f"cached hash points to block {block_id} with another hash")
