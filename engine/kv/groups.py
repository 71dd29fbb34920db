"""KV-cache groups: a model whose layers mix full attention and sliding windows (Gemma 2/3, Qwen2 with
max_window_layers) keeps one block pool and one block table per request for each distinct window, so a
sliding group's blocks are freed as its window passes while the full group keeps the whole context.

Layout (decided here; vLLM's hybrid KV cache manager shares one pool between groups of equal layer
counts instead): each group has its OWN pool, a cache tensor per layer of the group, [num_blocks_g, ...]
(engine/kv/cache.py), sized at start-up from the layer mix (group_block_counts). A sliding group needs at
most window_blocks_bound blocks at once, so it gets that many (never more than the full group) and the
rest of the budget goes to the full group: a long context's KV costs the full layers' bytes per token
plus a bounded amount for the local layers. Group 0 is the full-attention group (or the only group);
group g > 0 keeps its tables in request.kv_groups[g - 1] (engine/request.py GroupTable).

A model with one group (Llama; Mistral with its window on every layer) uses the plain BlockManager:
exactly the behaviour and the cost of before. GroupedBlockManager IS group 0's BlockManager (the
scheduler, stats and KV events see it as before) and drives one more BlockManager per other group.

Prefix caching stays exact: every group registers its computed blocks under the same chained hashes.
A hit of n blocks needs group 0's n blocks and, in each sliding group, only the blocks its window still
reads at position n * block_size (blocks first..n-1, first = (n * block_size - W + 1) // block_size;
the ones before stand as NULL_BLOCK placeholders, as if freed by the window); when a sliding group lost
one of those (evicted from its smaller pool), the hit is shortened to the longest n for which every
group has them (vLLM's rule). KV events (engine/kv/events.py) and the prefix-cache counters describe
group 0 only: its hashes name the whole prefix, and a router reading them may overestimate a hit by the
shortening above, never serve wrong K/V.
"""

from __future__ import annotations

from engine.kv.block_manager import BlockManager, chain_hash, root_hash
from engine.request import Request


def window_blocks_bound(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Most blocks a sliding group with this window holds at once: per running sequence, the blocks its
    window still reads (ceil((W - 1) / bs) + 1 whatever the alignment) plus the one being filled and one
    for a step's new tokens crossing a block edge, then the blocks of one step's new tokens (a long
    prefill chunk is written whole before its early blocks leave the window)."""
    per_seq = -(-(window - 1) // block_size) + 3
    return max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)


def group_block_counts(bytes_per_block: list[int], windows: list[int | None], equal_blocks: int,
                       budget_bytes: int | None, block_size: int, max_num_seqs: int,
                       max_num_batched_tokens: int) -> list[int]:  # fmt: skip
    """Blocks per group. `equal_blocks`: what every group would get sharing the budget evenly (the
    blocks of a one-group cache of the whole model). A sliding group gets min(its bound, equal_blocks);
    group 0 gets the rest of `budget_bytes` (None: a fixed block count was asked for: equal_blocks)."""
    counts = [equal_blocks]
    for w in windows[1:]:
        bound = equal_blocks if w is None else window_blocks_bound(w, block_size, max_num_seqs, max_num_batched_tokens)
        counts.append(min(bound, equal_blocks))
    if budget_bytes is not None:
        rest = budget_bytes - sum(n * b for n, b in zip(counts[1:], bytes_per_block[1:], strict=True))
        counts[0] = max(equal_blocks, rest // bytes_per_block[0])
    return counts


class GroupedBlockManager(BlockManager):
    """Group 0's BlockManager (itself) plus one per other group (`others`), kept in step: every call the
    scheduler makes is applied to each group; allocation succeeds in all or changes none."""

    def __init__(self, num_blocks: list[int], block_size: int, windows: list[int | None],
                 enable_prefix_caching: bool = True, record_events: bool = False, event_hash_salt: int = 0,
                 rope_switch: int | None = None) -> None:  # fmt: skip
        if len(num_blocks) != len(windows) or len(windows) < 2:
            raise ValueError("GroupedBlockManager needs a block count and a window per group, two groups at least")
        super().__init__(num_blocks[0], block_size, enable_prefix_caching, record_events, event_hash_salt,
                         sliding_window=windows[0], rope_switch=rope_switch)  # fmt: skip
        self.windows = windows
        self.others = [BlockManager(n, block_size, enable_prefix_caching, sliding_window=w, rope_switch=rope_switch,
                                    group=g)
                       for g, (n, w) in enumerate(zip(num_blocks[1:], windows[1:], strict=True), start=1)]  # fmt: skip

    # ---- prefix hits ---------------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[int]:
        hits = super().find_cached_prefix(request)
        if not hits:
            return hits
        chain = self._chain(request, len(hits))
        for n in range(len(hits), 0, -1):  # the longest prefix every group can serve
            if all(self._window_hit(m, chain, n) is not None for m in self.others):
                return hits[:n]
        return []

    def acquire_cached_prefix(self, request: Request, block_ids: list[int], first: int = 0,
                              last_hash: int | None = None) -> None:  # fmt: skip
        n = len(block_ids)
        chain = self._chain(request, n)
        super().acquire_cached_prefix(request, block_ids)
        for m in self.others:
            ids = self._window_hit(m, chain, n)
            if ids is None:
                raise RuntimeError(f"KV group {m.group} lost a prefix block between lookup and acquire")
            m.acquire_cached_prefix(request, ids, self._first(m, n), chain[n - 1][0] if n else None)

    def fits(self, request: Request, cached: list[int], num_new_tokens: int, first: int = 0) -> bool:
        if not super().fits(request, cached, num_new_tokens):
            return False
        n = len(cached)
        chain = self._chain(request, n) if n else []
        for m in self.others:
            ids = self._window_hit(m, chain, n) if n else []
            if ids is None or not m.fits(request, ids, num_new_tokens, self._first(m, n)):
                return False
        return True

    def _chain(self, request: Request, n: int) -> list[tuple[int, tuple[int, ...]]]:
        """(chained hash, token ids) of the request's first n blocks."""
        bs, parent = self.block_size, root_hash(request, self.rope_switch)
        out = []
        for i in range(n):
            tokens = tuple(request.tokens(i * bs, (i + 1) * bs))
            parent = chain_hash(parent, tokens)
            out.append((parent, tokens))
        return out

    def _first(self, m: BlockManager, n: int) -> int:
        """The first of a prefix of n blocks that group m's window still reads at position n * block_size."""
        w = m.sliding_window
        return 0 if w is None else max(0, n * self.block_size - w + 1) // self.block_size

    def _window_hit(self, m: BlockManager, chain: list[tuple[int, tuple[int, ...]]], n: int) -> list[int] | None:
        """Group m's cached blocks first..n-1 of the prefix; None when one of them is not cached there."""
        ids = []
        for h, tokens in chain[self._first(m, n) : n]:
            block_id = m._cached.get(h)
            if block_id is None or m.blocks[block_id].token_ids != tokens:
                return None
            ids.append(block_id)
        return ids

    # ---- every group in step -----------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        if self.blocks_needed(request, num_new_tokens) > self.num_free_blocks or any(
            m.blocks_needed(request, num_new_tokens) > m.num_free_blocks for m in self.others
        ):
            return False
        for m in (self, *self.others):
            BlockManager.allocate(m, request, num_new_tokens)
        return True

    def free(self, request: Request) -> None:
        for m in self.others:
            m.free(request)
        super().free(request)

    def register_computed_blocks(self, request: Request) -> None:
        super().register_computed_blocks(request)
        for m in self.others:
            m.register_computed_blocks(request)

    def release_out_of_window(self, request: Request) -> int:
        return super().release_out_of_window(request) + sum(m.release_out_of_window(request) for m in self.others)

    def truncate(self, request: Request) -> None:
        super().truncate(request)
        for m in self.others:
            m.truncate(request)

    def reset_prefix_cache(self) -> bool:
        if any(m.num_used_blocks for m in self.others) or not super().reset_prefix_cache():
            return False
        for m in self.others:
            m.reset_prefix_cache()
        return True

    def check_integrity(self, requests=()) -> None:
        requests = list(requests)
        super().check_integrity(requests)
        for m in self.others:
            m.check_integrity(requests)

    def held_blocks(self, request: Request) -> list[int]:
        """Per group, how many live blocks the request holds (placeholders of freed blocks not counted)."""
        return [len(t.block_ids) - t.num_freed_blocks for t in (m.table(request) for m in (self, *self.others))]
