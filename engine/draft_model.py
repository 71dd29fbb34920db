"""The draft-model proposer (vLLM's `"method": "draft_model"` with `"model": path`): a smaller model
with the target's tokenizer drafts k tokens greedily.

Simplest correct KV handling: the draft model keeps no state between proposals. Each proposal
recomputes the last `DRAFT_WINDOW` tokens of the request (prompt + output) as one prefill into a
private one-sequence paged KV cache (enough blocks for the window plus k), then decodes k - 1 more
tokens over it. Positions are the tokens' true positions (RoPE), slots are window-relative. So the
draft costs one window prefill plus k - 1 one-token decodes per speculating request and step; it never
sees rolled-back drafts, preemptions or prefix-cache hits, and nothing leaks. The drafts are a point
mass (greedy): rejection sampling stays exact for sampled requests (engine/spec_verify.py). The draft
model runs on the reference attention backend in the target's dtype and device.
"""

from __future__ import annotations

import logging

import torch

from engine import setup
from engine.attention import BatchLayout, select_backend
from engine.kv_cache import allocate_kv_cache
from engine.loader import load_model
from engine.model_open import open_model_source
from engine.models.layers import ForwardContext
from engine.request import Request
from engine.spec_config import SpeculativeConfig

log = logging.getLogger("tokenmill.engine")

DRAFT_WINDOW = 512  # tokens of context the draft model sees (the request's last ones)
DRAFT_BLOCK_SIZE = 16


class DraftModelProposer:
    """Greedy drafts from a smaller model over the request's last DRAFT_WINDOW tokens."""

    def __init__(self, model, hf_config, device: torch.device, dtype: torch.dtype, max_drafts: int,
                 window: int = DRAFT_WINDOW) -> None:  # fmt: skip
        self.model = model
        self.device = device
        self.window = window
        self.backend = select_backend(device, "torch", dtype)
        bs = DRAFT_BLOCK_SIZE
        self.num_blocks = -(-(window + max_drafts) // bs)
        spec = setup.kv_spec(hf_config, bs, dtype)
        # one sequence: [num_layers] x (k_cache, v_cache), block i holds window slots [i * bs, (i + 1) * bs)
        self.kv = allocate_kv_cache(spec, self.num_blocks, device, self.backend)
        self.table = list(range(self.num_blocks))

    @torch.inference_mode()
    def propose(self, req: Request, k: int) -> list[int]:
        tokens = (req.prompt_token_ids + req.output_token_ids)[-self.window :]
        first = req.num_tokens - len(tokens)  # true position of tokens[0]
        logits = self._run(tokens, first, 0)
        out: list[int] = []
        for i in range(k):
            t = int(logits.argmax())
            out.append(t)
            if i + 1 < k:
                logits = self._run([t], first + len(tokens) + i, len(tokens) + i)
        return out

    def _run(self, ids: list[int], position: int, slot: int) -> torch.Tensor:
        """ids at true positions [position, ...) into window slots [slot, ...), attending over slots
        [0, slot + len(ids)). The last token's logits: [vocab]."""
        n, end = len(ids), slot + len(ids)
        layout = BatchLayout(num_decodes=1 if n == 1 else 0, query_lens=[n], context_lens=[end],
                             block_tables=[self.table], block_size=DRAFT_BLOCK_SIZE,
                             slot_mapping=torch.arange(slot, end, dtype=torch.long))  # fmt: skip
        ctx = ForwardContext(self.backend, self.backend.build_metadata(layout, self.device), self.kv)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos_t = torch.arange(position, position + n, dtype=torch.long, device=self.device)
        hidden = self.model(ids_t, pos_t, ctx)
        return self.model.compute_logits(hidden[-1:])[0]


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
