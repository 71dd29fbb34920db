"""Runs one scheduled step: packs the batch, runs the model over the paged cache, samples."""

from __future__ import annotations

import dataclasses

import torch

from engine.attention import AttentionBackend, BatchLayout
from engine.lora.batch import LoraBatch, build_batch
from engine.lora.registry import LoraRegistry
from engine.models.layers import ForwardContext
from engine.models.llama import LlamaForCausalLM
from engine.runner.cuda_graphs import DecodeGraphRunner
from engine.sample.prompt_logprobs import compute_prompt_logprobs
from engine.sample.sampler import Sampler
from engine.sample.verify import verify_rows
from engine.sched.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.state.batch import StateBatch
from engine.state.checkpoint_store import CheckpointStore


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, kv_caches, backend: AttentionBackend, block_size: int,
        device: torch.device, sampler: Sampler, graphs: DecodeGraphRunner | None = None,
        loras: LoraRegistry | None = None,
        one_row_attention: bool = False, kv_groups: int = 1,
        conv_state: torch.Tensor | None = None, delta_state: torch.Tensor | None = None,
        ssm_state: torch.Tensor | None = None, checkpoints: CheckpointStore | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.graphs = graphs  # CUDA graphs for decode-only steps; None: every step runs eagerly
        self.loras = loras  # adapters' device copies by lora_id; None: LoRA off
        # Every prompt chunk packed as one decode per position, so each query row attends through the
        # decode kernel whatever its chunk (batch-invariant mode, engine/models/batch_invariant.py).
        self.one_row_attention = one_row_attention
        # KV-cache groups (engine/kv/groups.py): > 1, each step also packs the other groups' block tables and
        # slots (request.kv_groups), and every layer reads its group's metadata (ForwardContext.group_metas)
        self.kv_groups = kv_groups
        # LongRoPE's switch position (None: another rope type): the tokens below it of a sequence longer
        # than it take the long factors (engine/models/rope.py LongRopeEmbedding)
        self.rope_switch: int | None = getattr(model, "rope_switch", None)
        # A hybrid model's conv state [conv_layers, slots, channels, width] (engine/state/conv_cache.py): each
        # step hands the layers its sequences' rows and slots (StateBatch); None: a model without one
        self.conv_state = conv_state
        # Gated DeltaNet layers' recurrent matrices [delta_layers, slots, heads, k_dim, v_dim] in the same slots
        # (engine/state/delta_cache.py; Qwen3.5); None: a model without them
        self.delta_state = delta_state
        # Mamba2 layers' SSM states [mamba_layers, slots, heads, head_dim, d_state] in the same slots
        # (engine/state/ssm_cache.py; Granite 4); None: a model without them
        self.ssm_state = ssm_state
        # Its state checkpoints (engine/state/checkpoint_store.py): loaded into the state slots of requests
        # that resume from one before the forward pass, saved after it; None: no checkpoints
        self.checkpoints = checkpoints

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        # Decodes first (the backend batches them; a row with drafts is one decode per position), then
        # prefill chunks.
        items = sorted(sched.scheduled, key=lambda s: s.num_tokens != 1 and not s.draft_token_ids)
        input_ids, positions, layout = self._pack(items)
        rope_long = self._rope_long(items)
        state = self._state_batch(items)
        if self.checkpoints is not None:  # loads first: a save of this step may overwrite a slot loaded from
            self.checkpoints.load([(s.state_load, s.request.state_slot) for s in items
                                   if s.state_load is not None and s.request.state_slot is not None])  # fmt: skip
        hidden = self._forward(input_ids, positions, layout, self._lora_batch(items), rope_long, state)  # [T, hidden]
        if self.checkpoints is not None:
            self.checkpoints.save([(s.request.state_slot, s.state_save) for s in items
                                   if s.state_save is not None and s.request.state_slot is not None])  # fmt: skip
        prompt_lps = compute_prompt_logprobs(self.model, hidden, items)  # {} unless a request asked
        ends: list[int] = []  # rows of `hidden` whose logits are needed
        plain: list[int] = []  # of those, the rows sampled as usual (index into ends)
        reqs: list = []
        spec: list[tuple[ScheduledRequest, int]] = []  # rows with drafts, index of their first row in ends
        offset = 0
        for s in items:
            offset += s.num_tokens
            if s.sample and s.draft_token_ids:  # logits at the known token and at every draft
                spec.append((s, len(ends)))
                ends.extend(range(offset - len(s.draft_token_ids) - 1, offset))
            elif s.sample:
                plain.append(len(ends))
                ends.append(offset - 1)
                reqs.append(s.request)
        if not ends:
            return ModelRunnerOutput({}, {}, prompt_logprobs=prompt_lps)
        logits = self.model.compute_logits(hidden[torch.tensor(ends, device=self.device)])
        tokens, lps = self.sampler.sample(logits[plain] if spec else logits, reqs) if reqs else ([], [])
        sampled = {r.request_id: t for r, t in zip(reqs, tokens, strict=True) if t is not None}
        failed = [r.request_id for r, t in zip(reqs, tokens, strict=True) if t is None]
        logprobs = {r.request_id: lp for r, lp in zip(reqs, lps, strict=True) if lp is not None}
        verified, spec_lps = verify_rows(self.sampler, logits, spec)
        failed += [rid for rid, toks in verified.items() if toks is None]
        spec_tokens = {rid: toks for rid, toks in verified.items() if toks is not None}
        self._rope_cap(spec_tokens, spec_lps, spec)
        return ModelRunnerOutput(sampled, logprobs, failed, prompt_lps, spec_tokens, spec_lps)

    def _lora_batch(self, items: list[ScheduledRequest]) -> LoraBatch | None:
        """The step's rows by adapter (in packing order); None when every row is on the base model."""
        if self.loras is None or not any(s.request.lora_id for s in items):
            return None
        runs = [(s.num_tokens, s.request.lora_id,
                 self.loras.resident(s.request.lora_id) if s.request.lora_id else None) for s in items]  # fmt: skip
        return build_batch(runs, self.device, invariant=self.one_row_attention)

    def _state_batch(self, items: list[ScheduledRequest]) -> StateBatch | None:
        """The step's sequences with their state slots, in packing order (a hybrid model); a chunk that
        starts at position 0 (a new request, or a preempted one computed again) starts from a zero
        window, any later one from its slot, which its previous chunk or decode left there."""
        if self.conv_state is None:
            return None
        slots = []
        for s in items:
            if s.request.state_slot is None:
                raise RuntimeError(f"request {s.request.request_id!r} runs without a state slot")
            slots.append(s.request.state_slot)
        return StateBatch.build(self.conv_state, [s.num_tokens for s in items], slots, [s.start == 0 for s in items],
                                self.delta_state, self.ssm_state)  # fmt: skip

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout,
                 lora: LoraBatch | None = None, rope_long: torch.Tensor | None = None,
                 state: StateBatch | None = None) -> torch.Tensor:  # fmt: skip
        """The model over one packed step (host tensors in): a decode graph's replay when one fits
        (graphs are captured without adapters or LongRoPE's long-factor rows: such a step runs eagerly)."""
        # graphs: one KV group, no adapters, no LongRoPE long rows, no hybrid state
        eager = lora is not None or rope_long is not None or bool(layout.group_layouts) or state is not None
        bucket = self.graphs.bucket_for(layout) if self.graphs is not None and not eager else None
        if bucket is not None:
            return self.graphs.run(bucket, input_ids, positions, layout)
        meta = self.backend.build_metadata(layout, self.device)
        group_metas = (meta, *(self.backend.build_metadata(g, self.device) for g in layout.group_layouts)
                       ) if layout.group_layouts else ()  # fmt: skip
        ctx = ForwardContext(self.backend, meta, self.kv_caches, lora=lora,
                             rope_long=self._send(rope_long) if rope_long is not None else None,
                             group_metas=group_metas, state=state)  # fmt: skip
        return self.model(self._send(input_ids), self._send(positions), ctx)

    def _rope_long(self, items: list[ScheduledRequest]) -> torch.Tensor | None:
        """LongRoPE: [T] 0/1 in packing order, 1 for a token below the switch of a request already longer
        than it (a long prompt, or a recompute after it passed the switch: transformers turns such a
        sequence in one pass with the long factors); None when the step has no such token (every other
        token's factors follow from its position, engine/models/rope.py LongRopeEmbedding)."""
        switch = self.rope_switch
        if switch is None or not any(s.request.num_tokens > switch and s.start < switch for s in items):
            return None
        rows: list[int] = []
        for s in items:
            below = max(0, min(s.start + s.num_tokens, switch) - s.start) if s.request.num_tokens > switch else 0
            rows.extend([1] * below + [0] * (s.num_tokens - below))
        return torch.tensor(rows, dtype=torch.long)

    def _rope_cap(self, spec_tokens: dict[str, list[int]], spec_lps: dict, spec: list) -> None:
        """LongRoPE: a verified row of a request not yet past the switch keeps only the tokens sampled at
        positions below it. The first token past it is the last it keeps; the engine core then computes
        the whole sequence again with the long factors (transformers' Phi-3 drops its cache there), so
        what the drafts past the switch would give on the short factors is never emitted."""
        switch = self.rope_switch
        if switch is None:
            return
        for s, _ in spec:
            rid, keep = s.request.request_id, switch - s.start  # row j is sampled at position start + j
            if s.request.num_tokens <= switch and rid in spec_tokens and len(spec_tokens[rid]) > keep:
                spec_tokens[rid] = spec_tokens[rid][:keep]
                if spec_lps.get(rid) is not None:
                    spec_lps[rid] = spec_lps[rid][:keep]

    def _send(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # pinned, so the copy does not block the host
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)

    def _pack(self, items: list[ScheduledRequest]):
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        bs = self.block_size
        extra: list[tuple[list[int], list[list[int]]]] = [([], []) for _ in range(self.kv_groups - 1)]  # slots, tables
        for s in items:
            req, start, end = s.request, s.start, s.start + s.num_tokens
            ids.extend(req.tokens(start, end - len(s.draft_token_ids)) + s.draft_token_ids)
            pos.extend(range(start, end))
            table = req.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            # A row with drafts (a decode) attends as one decode per position over the same block table:
            # every token's K/V is stored before attention, so position p sees the drafts before it.
            split = bool(s.draft_token_ids) or self.one_row_attention  # (drafts come with a one-token decode only)
            for a, b in ([(p, p + 1) for p in range(start, end)] if split else [(start, end)]):
                query_lens.append(b - a)
                context_lens.append(b)
                tables.append(table)
            if extra:  # the other KV groups: the same rows over their tables
                for g, (g_slots, g_tables) in enumerate(extra):
                    g_table = req.kv_groups[g].block_ids
                    g_slots.extend(g_table[p // bs] * bs + p % bs for p in range(start, end))
                    g_tables.extend([g_table] * (end - start if split else 1))
        layout = BatchLayout(
            num_decodes=sum(1 for q in query_lens if q == 1),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=tables,
            block_size=bs,
            slot_mapping=torch.tensor(slots, dtype=torch.long),
        )
        if extra:
            layout.group_layouts = [dataclasses.replace(layout, block_tables=g_tables, group_layouts=[],
                                                        slot_mapping=torch.tensor(g_slots, dtype=torch.long))
                                    for g_slots, g_tables in extra]  # fmt: skip
        return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), layout  # on the host
