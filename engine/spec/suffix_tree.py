"""Suffix decoding's proposer (vLLM's `"method": "suffix"`, after SuffixDecoding, arXiv 2411.04975):
drafts from the outputs of the engine's earlier requests, plain Python.

`SuffixTree` counts every substring of at most `max_depth` tokens of the sequences it holds (a trie
of their suffixes, each node's count the number of times its path occurs). A finished request's
output (after the last max_depth - 1 prompt tokens, so a context that spans the prompt's end
matches) goes in; the least recently added sequences go out when more than `max_cached_requests` are
held or the trie passes `MAX_TREE_NODES` nodes, so its memory is bounded whatever the traffic.

`SuffixProposer.propose` matches the longest suffix of the request's tokens (at most max_depth -
min(k, max_depth / 2), so a draft of that many tokens fits in the tree's depth) that occurs in the tree with a continuation, then follows the most frequent child while its share of
its parent's count is at least `min_token_prob`, for at most k and `max_spec_factor` x the match
length tokens (a longer match earns a longer draft). The request's own prompt and output are searched
too, by n-gram prompt lookup (engine/spec/drafts.py), and the longer draft is proposed.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from engine.config.speculative import SpeculativeConfig
from engine.request import Request
from engine.spec.drafts import ngram_propose

MAX_TREE_NODES = 1 << 19  # ~524k trie nodes (on the order of 100 MB of Python objects) at most
MAX_CACHED_OUTPUT_TOKENS = 2048  # a request's output beyond this many tokens is not cached (its tail is)


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0  # occurrences of this node's path in the held sequences
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """Substring counts of a bounded, least-recently-added-first set of token sequences."""

    def __init__(self, max_depth: int, max_sequences: int, max_nodes: int = MAX_TREE_NODES) -> None:
        self.max_depth, self.max_sequences, self.max_nodes = max_depth, max_sequences, max_nodes
        self.root = _Node()
        self.num_nodes = 0
        self._seqs: OrderedDict[int, list[int]] = OrderedDict()  # insertion key -> the sequence
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, tokens: list[int]) -> None:
        """Hold `tokens` (every substring up to max_depth counted); evict the oldest past the bounds."""
        if self.max_sequences == 0 or len(tokens) < 2:
            return
        key, self._next_key = self._next_key, self._next_key + 1
        self._seqs[key] = list(tokens)
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i : i + self.max_depth]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                    self.num_nodes += 1
                child.count += 1
                node = child
        while self._seqs and (len(self._seqs) > self.max_sequences or self.num_nodes > self.max_nodes):
            self._remove(next(iter(self._seqs)))

    def _remove(self, key: int) -> None:
        tokens = self._seqs.pop(key)
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i : i + self.max_depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:  # its descendants count no more than it: the whole subtree goes
                    del node.children[t]
                    self.num_nodes -= _size(child)
                    break
                node = child

    def propose(self, context: list[int], k: int, spec_factor: float, min_prob: float) -> list[int]:
        """Up to k tokens most often following the longest suffix of `context` the tree holds."""
        # a match leaves room for min(k, max_depth // 2) draft tokens within max_depth (at least 1 token
        # is matched): with vLLM's default k (the depth itself) matches of up to half the depth
        for m in range(min(max(1, self.max_depth - min(k, self.max_depth // 2)), len(context)), 0, -1):
            node: _Node | None = self.root
            for t in context[len(context) - m :]:
                node = node.children.get(t) if node is not None else None
            if node is None or not node.children:
                continue
            limit = min(k, self.max_depth - m, max(1, math.floor(spec_factor * m)))
            out: list[int] = []
            while node.children and len(out) < limit:
                t, child = max(node.children.items(), key=lambda kv: kv[1].count)
                if child.count < min_prob * node.count:
                    break
                out.append(t)
                node = child
            if out:
                return out
        return []


def _size(node: _Node) -> int:
    """Nodes in the subtree under and including node."""
    n, stack = 0, [node]
    while stack:
        x = stack.pop()
        n += 1
        stack.extend(x.children.values())
    return n


class SuffixProposer:
    """vLLM's "suffix" method: the engine's earlier outputs (a SuffixTree) and the request's own tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.tree = SuffixTree(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests)

    def propose(self, req: Request, k: int) -> list[int]:
        c = self.config
        tokens = req.prompt_token_ids + req.output_token_ids
        depth = c.suffix_decoding_max_tree_depth
        shared = self.tree.propose(tokens[-(depth - 1) :] if depth > 1 else [], k,
                                   c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob)  # fmt: skip
        own = ngram_propose(tokens, k, c.prompt_lookup_max, c.prompt_lookup_min)
        return own if len(own) > len(shared) else shared

    def finished(self, req: Request) -> None:
        """Cache req's output (after the end of its prompt) for later requests."""
        if not req.output_token_ids:
            return
        head = self.config.suffix_decoding_max_tree_depth - 1
        prompt_tail = req.prompt_token_ids[-head:] if head > 0 else []
        self.tree.add(prompt_tail + req.output_token_ids[-MAX_CACHED_OUTPUT_TOKENS:])
