"""The draft-model proposer (vLLM's `"method": "draft_model"` with `"model": path`): a smaller model
with the target's tokenizer drafts k tokens greedily.

Simplest correct KV handling: the draft model keeps no state between proposals. Each step's proposal
recomputes the last `DRAFT_WINDOW` tokens of every speculating request (prompt + output) as one
prefill chunk per request into a private paged KV cache (one region of blocks per row, enough for the
window plus k), then decodes k - 1 more tokens over it. All rows run together (the scheduler asks for
the step's drafts at once, engine/spec/proposers.py's BatchProposer): one forward for the windows, then
one batched decode per further draft position, in groups of at most `MAX_DRAFT_ROWS` rows. Positions
are the tokens' true positions (RoPE), slots are window-relative. It never sees rolled-back drafts,
preemptions or prefix-cache hits, and nothing leaks. The drafts are a point
mass (greedy): rejection sampling stays exact for sampled requests (engine/sample/verify.py). The draft
model runs on the reference attention backend in the target's dtype and device.
"""

from __future__ import annotations

import logging

import torch

from engine.attention import BatchLayout, select_backend
from engine.config.speculative import SpeculativeConfig
from engine.kv.cache import allocate_kv_cache
from engine.models.layers import ForwardContext
from engine.request import Request
from engine.runner import startup
from engine.weights.loader import load_model
from engine.weights.model_open import open_model_source

log = logging.getLogger("tokenmill.engine")

DRAFT_WINDOW = 512  # tokens of context the draft model sees (the request's last ones)
DRAFT_BLOCK_SIZE = 16
MAX_DRAFT_ROWS = 16  # sequences drafted in one forward (its private cache holds this many); more: groups


class DraftModelProposer:
    """Greedy drafts from a smaller model over each request's last DRAFT_WINDOW tokens, for every
    speculating row of a step at once (`propose_all`, engine/spec/proposers.py's BatchProposer)."""

    def __init__(self, model, hf_config, device: torch.device, dtype: torch.dtype, max_drafts: int,
                 window: int = DRAFT_WINDOW, max_rows: int = MAX_DRAFT_ROWS) -> None:  # fmt: skip
        self.model = model
        self.device = device
        self.window = window
        self.max_rows = max_rows
        self.backend = select_backend(device, "torch", dtype)
        self.blocks_per_row = -(-(window + max_drafts) // DRAFT_BLOCK_SIZE)
        self.spec = startup.kv_spec(hf_config, DRAFT_BLOCK_SIZE, dtype)
        self.rows = 0  # sequences the cache holds now; grown to the largest group seen (<= max_rows)
        self.kv: list = []
        self._grow(1)

    def _grow(self, rows: int) -> None:
        """A private cache of `rows` sequences: [num_layers] x (k_cache, v_cache); row r owns blocks
        [r * blocks_per_row, (r + 1) * blocks_per_row), its window slots in order."""
        if rows <= self.rows:
            return
        self.kv = allocate_kv_cache(self.spec, rows * self.blocks_per_row, self.device, self.backend)
        self.rows = rows

    def propose(self, req: Request, k: int) -> list[int]:
        return self.propose_all([(req, k)])[0]

    @torch.inference_mode()
    def propose_all(self, items: list[tuple[Request, int]]) -> list[list[int]]:
        """Up to k drafts for each (request, k), in order: groups of max_rows rows, each one batched
        window prefill, then one batched decode per further draft position."""
        out: list[list[int]] = []
        for g in range(0, len(items), self.max_rows):
            out.extend(self._draft_group(items[g : g + self.max_rows]))
        return out

    def _draft_group(self, items: list[tuple[Request, int]]) -> list[list[int]]:
        self._grow(len(items))
        windows = [(req.prompt_token_ids + req.output_token_ids)[-self.window :] for req, _ in items]
        firsts = [req.num_tokens - len(w) for (req, _), w in zip(items, windows, strict=True)]  # true positions
        lens = [len(w) for w in windows]
        rows = list(range(len(items)))
        logits = self._run(rows, windows, firsts, [0] * len(rows))
        drafts: list[list[int]] = [[] for _ in items]
        for step in range(max(k for _, k in items)):
            for r, t in zip(rows, logits.argmax(-1).tolist(), strict=True):
                drafts[r].append(int(t))
            rows = [r for r in rows if len(drafts[r]) < items[r][1]]
            if not rows:
                break
            # the last draft of each row still drafting, at window slot lens + step
            logits = self._run(rows, [[drafts[r][-1]] for r in rows], [firsts[r] + lens[r] + step for r in rows],
                               [lens[r] + step for r in rows])  # fmt: skip
        return drafts

    def _run(self, rows: list[int], ids: list[list[int]], positions: list[int], slots: list[int]) -> torch.Tensor:
        """For each row r of `rows`: ids at true positions [position, ...) into its window slots [slot,
        ...), attending over its slots [0, slot + len(ids)). Each row's last token's logits: [rows, vocab]."""
        order = sorted(range(len(rows)), key=lambda i: len(ids[i]) != 1)  # one-token rows are decodes: first
        bs, span = DRAFT_BLOCK_SIZE, self.blocks_per_row
        flat_ids, flat_pos, flat_slots, tables, q_lens, ctx_lens = [], [], [], [], [], []
        for i in order:
            n, base = len(ids[i]), rows[i] * span * bs
            flat_ids += ids[i]
            flat_pos += range(positions[i], positions[i] + n)
            flat_slots += range(base + slots[i], base + slots[i] + n)
            tables.append(list(range(rows[i] * span, (rows[i] + 1) * span)))
            q_lens.append(n)
            ctx_lens.append(slots[i] + n)
        layout = BatchLayout(num_decodes=sum(n == 1 for n in q_lens), query_lens=q_lens, context_lens=ctx_lens,
                             block_tables=tables, block_size=bs,
                             slot_mapping=torch.tensor(flat_slots, dtype=torch.long))  # fmt: skip
        ctx = ForwardContext(self.backend, self.backend.build_metadata(layout, self.device), self.kv)
        ids_t = torch.tensor(flat_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(flat_pos, dtype=torch.long, device=self.device)
        hidden = self.model(ids_t, pos_t, ctx)
        ends = torch.tensor(q_lens, device=self.device).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[ends])  # [rows, vocab] in `order`
        back = torch.empty(len(order), dtype=torch.long, device=self.device)
        back[torch.tensor(order, device=self.device)] = torch.arange(len(order), device=self.device)
        return logits[back]


def load_draft_proposer(config: SpeculativeConfig, target_vocab: int, device: torch.device, dtype: torch.dtype,
                        max_model_len: int) -> DraftModelProposer:  # fmt: skip
    """The draft model of config.model loaded (ValueError naming speculative.model when it cannot be, or
    its vocabulary is not the target's)."""
    try:
        source = open_model_source(str(config.model))
    except ValueError as exc:
        raise ValueError(f"speculative.model: {exc}") from None
    vocab = int(source.hf_config.vocab_size)
    if vocab != target_vocab:
        raise ValueError(f"speculative.model: its vocabulary has {vocab} tokens, the target's {target_vocab}: "
                         "a draft model needs the target's tokenizer")  # fmt: skip
    model = load_model(source, dtype, device, max_model_len + config.num_speculative_tokens, show_progress=False)
    log.info("draft model %s loaded for speculative decoding (k=%d)", source.name, config.num_speculative_tokens)
    return DraftModelProposer(model, source.hf_config, device, dtype, config.num_speculative_tokens)
