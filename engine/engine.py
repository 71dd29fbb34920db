"""The engine with its model: loads the weights, sizes the KV cache, builds the model runner, and hands
them to `StepLoop` (engine/core/step_loop.py), which does everything else (schedule, run, update)."""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time

import torch

from engine.api.errors import LoraError
from engine.attention import for_sinks, select_backend
from engine.config import EngineConfig
from engine.config.engine_config import resolve_step_budget
from engine.core.step_loop import GenerationResult, StepLoop
from engine.core.thread_count import ThreadPin, per_thread_setter
from engine.core.thread_governor import GovernorConfig, ThreadGovernor
from engine.kernels import cpu_kernels
from engine.kv.block_manager import BlockManager
from engine.kv.cache import allocate_grouped_kv_cache, allocate_kv_cache
from engine.kv.events import KVEventSink
from engine.kv.groups import GroupedBlockManager, group_block_counts
from engine.lora.loading import make_registry
from engine.models import batch_invariant, model_class
from engine.models.moe import MoeCausalLM
from engine.models.windows import group_windows, layer_groups, layer_windows
from engine.runner import startup
from engine.runner.cuda_graphs import capture_graphs, graph_buckets, graphs_enabled
from engine.runner.model_runner import ModelRunner
from engine.runner.profiling import activation_peak_bytes
from engine.sample.sampler import Sampler
from engine.sched.scheduler import SchedulerConfig
from engine.state.checkpoint_store import CheckpointStore, checkpoint_slots
from engine.state.checkpoints import CheckpointIndex
from engine.state.conv_cache import HybridSlot, allocate_conv_state, split_budget
from engine.state.delta_cache import allocate_delta_state
from engine.state.pool import StatePool
from engine.state.ssm_cache import allocate_ssm_state
from engine.structured import make_compiler
from engine.weights.cpu_weights import prepare_weights
from engine.weights.gguf.blocks import blocks_for
from engine.weights.loader import load_model
from engine.weights.model_open import open_model_source, with_tokenizer

__all__ = ["Engine", "GenerationResult"]

log = logging.getLogger("tokenmill.engine")


class Engine(StepLoop):
    def __init__(self, config: EngineConfig, clock=time.monotonic, kv_event_sink: KVEventSink | None = None) -> None:
        """`kv_event_sink`: where the prefix cache's changes are published (engine/kv/events.py); None: off."""
        source = open_model_source(config.model)  # a HF folder or a GGUF file; every check before loading
        if config.tokenizer is not None:
            source = with_tokenizer(source, config.tokenizer)
        self.hf_config = source.hf_config
        self.device = startup.resolve_device(config.device)
        # every CPU kernel group and its path, for the ready line (TOKENMILL_REQUIRE_KERNELS=1: a group
        # that does not build or load stops the start here, before the weights are read)
        self.kernel_paths = cpu_kernels.describe() if self.device.type == "cpu" else "none (CUDA: Triton and torch)"
        budget = resolve_step_budget(config.max_num_batched_tokens, self.device)
        config = dataclasses.replace(config, max_num_batched_tokens=budget)
        self.config = config
        if self.device.type == "cuda":  # an engine freed earlier in this process (an unloaded model version)
            torch.cuda.empty_cache()  # leaves its blocks cached: give them back before measuring free memory
        startup.apply_cpu_threads(config.cpu_threads, self.device)
        self.dtype = startup.resolve_dtype(config.dtype, self.hf_config, self.device)
        self.max_model_len = startup.resolve_max_model_len(config, self.hf_config)
        self.block_size = startup.resolve_block_size(config.block_size, self.device)
        if model_class(getattr(self.hf_config, "architectures", None)).hybrid:
            _check_hybrid_config(config)  # before any weight is read
        blocks = blocks_for(source, config, self.device)  # GGUF matrices kept quantized
        model = load_model(source, self.dtype, self.device, self.max_model_len, config.show_progress,
                           frozenset(blocks.held) if blocks else frozenset())
        # packing, kernels, INT8, GGUF blocks
        self.weights = prepare_weights(model, config, self.device, self.dtype, ggml=blocks.weights if blocks else None,
                                       ggml_text=blocks.describe() if blocks else "gguf")
        self.packed_weights = self.weights.packed
        # a hybrid model's recurrent layers (LFM2's short convs: engine/state/); None: attention only
        state_spec = model.conv_state_spec(self.dtype)
        # Qwen3.5's Gated DeltaNet layers keep a recurrent matrix per sequence, Granite 4's Mamba2 layers an SSM
        # matrix, in the same slots as the conv windows; a slot's bytes count every such tensor
        delta_spec = model.delta_state_spec() if state_spec is not None else None
        ssm_spec = model.ssm_state_spec() if state_spec is not None else None
        slot_spec = (HybridSlot(state_spec, tuple(r for r in (delta_spec, ssm_spec) if r is not None))
                     if state_spec is not None else None)  # fmt: skip
        if isinstance(model, MoeCausalLM):  # the experts' path on CUDA (Triton grouped GEMM or the loop)
            log.info("MoE experts: %s", model.select_experts(self.device, self.dtype, cpu_kernels.required()))
        backend = select_backend(self.device, config.attention_backend, self.dtype)
        if model.attention_sinks:  # GPT-OSS: a backend without sinks is refused, never run
            backend = for_sinks(backend, config.attention_backend)
        if config.deterministic and (reason := batch_invariant.unsupported(self.device, backend.name)):
            raise ValueError(f"deterministic {reason}")
        if backend.name == "cpu" and cpu_kernels.load("layers") is None:  # the layers use theirs too
            # (batch-invariant mode: the per-row norm kernel in float32 too)
            model.use_cpu_kernels(norms=self.dtype == torch.bfloat16 or config.deterministic,
                                  fused_decode=config.fused_decode)
        use_graphs = graphs_enabled(self.device, config.enforce_eager, backend)
        if use_graphs and (why_not := model.cuda_graphs_unsupported()) is not None:
            log.info("CUDA graphs: off for %s (%s): decode steps run eagerly", type(model).__name__, why_not)
            use_graphs = False
        buckets = graph_buckets(config.max_num_seqs)
        # KV blocks for the attention layers only (a hybrid model's conv layers keep a state slot instead)
        spec = dataclasses.replace(startup.kv_spec(self.hf_config, self.block_size, self.dtype),
                                   num_layers=model.num_kv_layers)
        num_blocks = config.num_kv_blocks
        budget_bytes: int | None = None  # the KV budget when sized from memory (None: a block count given)
        state_slots = config.max_num_seqs  # a hybrid model's state slots: one per seat (engine/state/conv_cache.py)
        windows, groups = group_windows(self.hf_config), layer_groups(self.hf_config)
        # a hybrid model reuses prefixes through state checkpoints (engine/state/checkpoints.py), with one KV
        # group (no sliding windows) and prefix caching on
        checkpointing = state_spec is not None and config.enable_prefix_caching and len(windows) == 1
        num_checkpoints = 0
        if num_blocks is None:
            cuda_profile = self.device.type == "cuda" and config.kv_cache_memory is None
            peak = activation_peak_bytes(model, backend, spec, self.device, min(budget, self.max_model_len),
                                         config.max_num_seqs, buckets[-1] if use_graphs else 0) if cuda_profile else 0
            budget_bytes = startup.kv_budget_bytes(config, self.device, peak)
            if state_spec is not None:  # the state pool first, then the checkpoints, the KV blocks get the rest
                assert slot_spec is not None
                state_slots, budget_bytes = split_budget(slot_spec, budget_bytes, config.max_num_seqs)
                if checkpointing:
                    num_checkpoints = checkpoint_slots(slot_spec.bytes_per_slot, budget_bytes, spec.bytes_per_block,
                                                       state_slots, config.num_state_checkpoints)  # fmt: skip
                    budget_bytes -= num_checkpoints * slot_spec.bytes_per_slot
            num_blocks = spec.num_blocks_for(budget_bytes)
        elif checkpointing:  # a block count given: no budget to split
            num_checkpoints = checkpoint_slots(0, None, 0, config.max_num_seqs, config.num_state_checkpoints)
        checkpointing = num_checkpoints > 0
        if num_blocks < 1:
            raise ValueError("kv_cache_memory is too small for one KV block")
        rows_kernel = backend.name == "cpu" and cpu_kernels.load("sampling") is None
        self.sampler = Sampler(config.seed, rows_kernel=rows_kernel)
        # KV-cache groups (engine/kv/groups.py): one per distinct layer window; block counts per group
        group_bytes = [dataclasses.replace(spec, num_layers=groups.count(g)).bytes_per_block
                       for g in range(len(windows))] if len(windows) > 1 else [spec.bytes_per_block]  # fmt: skip
        counts = group_block_counts(group_bytes, windows, num_blocks, budget_bytes, self.block_size,
                                    config.max_num_seqs, budget) if len(windows) > 1 else [num_blocks]  # fmt: skip
        kv = (allocate_grouped_kv_cache(spec, counts, groups, self.device, backend) if len(windows) > 1
              else allocate_kv_cache(spec, num_blocks, self.device, backend))  # fmt: skip
        self.kv_cache_bytes = sum(n * b for n, b in zip(counts, group_bytes, strict=True))
        self.kv_group_blocks = counts
        num_blocks = counts[0]
        # a hybrid model reuses a prefix only with a checkpoint of its state there: without checkpoints its
        # attention KV would be reused without the recurrent state that goes with it
        blocks_kw = dict(enable_prefix_caching=config.enable_prefix_caching and (state_spec is None or checkpointing),
                         record_events=kv_event_sink is not None,
                         event_hash_salt=secrets.randbits(64), rope_switch=getattr(model, "rope_switch", None))
        block_manager = (GroupedBlockManager(counts, self.block_size, windows, **blocks_kw) if len(windows) > 1
                         else BlockManager(num_blocks, self.block_size, sliding_window=windows[0], **blocks_kw))
        max_num_seqs, conv_state, delta_state, ssm_state, state_pool = config.max_num_seqs, None, None, None, None
        checkpoint_store, checkpoint_index = None, None
        self.state_cache_bytes = self.checkpoint_bytes = 0
        if state_spec is not None and slot_spec is not None:
            if state_slots < max_num_seqs:
                log.warning("max_num_seqs lowered from %d to %d: the cache budget holds %d state slots",
                            max_num_seqs, state_slots, state_slots)  # fmt: skip
            max_num_seqs = state_slots  # a seat needs a slot: the seats are bounded by the slots
            conv_state = allocate_conv_state(state_spec, state_slots, self.device)
            delta_state = allocate_delta_state(delta_spec, state_slots, self.device) if delta_spec else None
            ssm_state = allocate_ssm_state(ssm_spec, state_slots, self.device) if ssm_spec else None
            state_pool = StatePool(state_slots)
            self.state_cache_bytes = state_slots * slot_spec.bytes_per_slot
            if checkpointing:  # every state tensor [layers, slots, ...] of the model joins this list
                state = [conv_state] + [t for t in (delta_state, ssm_state) if t is not None]
                checkpoint_store = CheckpointStore(state, num_checkpoints)
                checkpoint_index = CheckpointIndex(num_checkpoints, self.block_size)
                self.checkpoint_bytes = checkpoint_store.bytes
            reuse = (f"prefix reuse: {num_checkpoints} state checkpoints at block boundaries "
                     f"({self.checkpoint_bytes / 2**20:.2f} MiB of the cache budget)" if checkpointing else
                     "prefix caching off (no state checkpoints: a recurrent state cannot be cut at a prefix)")  # fmt: skip
            if delta_spec is not None:
                layers = (f"{state_spec.num_layers} Gated DeltaNet layers with a conv state ({state_spec.width} "
                          "columns each) and float32 recurrent matrices (torch reference chunked scan and step)")
            elif ssm_spec is not None:
                layers = (f"{ssm_spec.num_layers} Mamba2 layers with a conv state ({state_spec.width} columns each) "
                          f"and an SSM state ([{ssm_spec.heads}, {ssm_spec.head_dim}, {ssm_spec.state_size}] float32 "
                          "each) (torch reference conv and scan)")
            else:
                layers = (f"{state_spec.num_layers} short-conv layers with a conv state ({state_spec.width} columns "
                          "each) (torch reference conv)")
            log.info("hybrid model: %s in %d slots (%.1f KiB each, %.2f MiB), KV blocks for its %d attention layers; "
                     "path: PyTorch layers (no fused decode, no CUDA graphs, no speculative decoding); %s", layers,
                     state_slots, slot_spec.bytes_per_slot / 1024, self.state_cache_bytes / 2**20,
                     model.num_kv_layers, reuse)  # fmt: skip
        graphs = capture_graphs(model, backend, kv, buckets, self.block_size, self.max_model_len,
                                self.device) if use_graphs else None
        loras = make_registry(config.lora, self.hf_config, self.device, self.dtype) if config.lora else None
        super().__init__(
            model_name=source.name,
            tokenizer=source.tokenizer,
            runner=ModelRunner(model, kv, backend, self.block_size, self.device, self.sampler, graphs, loras,
                               one_row_attention=config.deterministic, kv_groups=len(windows), conv_state=conv_state,
                               delta_state=delta_state, ssm_state=ssm_state, checkpoints=checkpoint_store),
            block_manager=block_manager,
            scheduler_config=SchedulerConfig(max_num_seqs, config.max_num_batched_tokens, config.aging_s,
                                             config.outranked_chunk_tokens, config.speculative,
                                             tenant_weights=config.tenant_weights,
                                             fair_seats=config.fair_seats),
            max_model_len=self.max_model_len,
            vocab_size=int(self.hf_config.vocab_size),
            eos_token_ids=source.eos_token_ids,
            clock=clock,
            grammar_compiler=make_compiler(config.grammar_backend, source.tokenizer, int(self.hf_config.vocab_size),
                                           source.eos_token_ids, config.grammar_cache_bytes,
                                           config.grammar_compile_processes),  # fmt: skip
            kv_event_sink=kv_event_sink,
            loras=loras,
            state_pool=state_pool,
            checkpoints=checkpoint_index,
        )
        threads = torch.get_num_threads()
        setter = per_thread_setter() if self.device.type == "cpu" else None  # the stepping thread's count only
        # not in the batch-invariant mode: the thread count stays the one set at start-up there
        if setter is not None and config.adaptive_threads and threads > 1 and not config.deterministic:
            gov = self.thread_governor = ThreadGovernor(GovernorConfig(high=threads), setter)
            self.thread_pin = ThreadPin(setter, lambda: gov.threads)
        elif setter is not None:
            self.thread_pin = ThreadPin(setter, lambda: threads)
        if config.speculative is not None and config.speculative.method == "draft_model":
            from engine.runner.draft_model import load_draft_proposer

            self.scheduler.proposer = load_draft_proposer(config.speculative, int(self.hf_config.vocab_size),
                                                          self.device, self.dtype, self.max_model_len)  # fmt: skip
        for name, path in config.lora.modules if config.lora else ():  # start-up adapters (--lora-modules)
            try:
                self.load_lora(name, path)
            except LoraError as exc:  # say which adapter
                raise type(exc)(exc.field, f"lora module {name!r}: {exc.message}") from None
        sliding = [w for w in layer_windows(self.hf_config) if w is not None]
        if sliding:  # which layers attend through a window; their blocks that left it are freed
            log.info("sliding window: %s tokens on %d of %d layers; KV blocks that left it: freed; KV groups "
                     "(window: blocks): %s", max(sliding), len(sliding), len(groups),
                     ", ".join(f"{w or 'full'}: {n}" for w, n in zip(windows, counts, strict=True)))  # fmt: skip
        if isinstance(model, MoeCausalLM):  # tokens per expert, for debugging (expert_counts)
            model.count_expert_tokens(self.device)
        log.info(
            "engine ready: %s, %s on %s, %d KV blocks x %d tokens (%d tokens, %.2f GiB), attention=%s, "
            "cuda graphs=%s, packed weights=%s, quantization=%s, CPU kernels: %s; small-batch linears: %s",
            self.model_name, str(self.dtype).removeprefix("torch."), self.device, num_blocks,
            self.block_size, num_blocks * self.block_size, self.kv_cache_bytes / 2**30, backend.name,
            ",".join(map(str, buckets)) if graphs else "off", self.packed_weights, self.weights.quantization,
            self.kernel_paths, self.weights.gemv,
        )

    # ---- names the server reads ------------------------------------------------------------------
    @property
    def dtype_name(self) -> str:  # type: ignore[override]
        return str(self.dtype).removeprefix("torch.")

    @property
    def device_name(self) -> str:  # type: ignore[override]
        return str(self.device)

    def expert_counts(self) -> list[list[int]] | None:
        """A mixture-of-experts model's tokens routed to each expert since start-up, per sparse layer
        (prompt, generated and speculative tokens alike); None for a dense model."""
        model = self.runner.model
        return model.expert_counts() if isinstance(model, MoeCausalLM) else None

    # ---- device memory ------------------------------------------------------------------------------
    def device_memory(self) -> dict[str, int] | None:
        """Device memory in bytes from CUDA (used and total on the device, allocated and reserved by
        this process's PyTorch, the KV cache); None on the CPU."""
        if self.device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        return {
            "used_bytes": int(total - free),
            "total_bytes": int(total),
            "allocated_bytes": int(torch.cuda.memory_allocated(self.device)),
            "reserved_bytes": int(torch.cuda.memory_reserved(self.device)),
            "kv_cache_bytes": int(self.kv_cache_bytes),
        }


def _check_hybrid_config(config: EngineConfig) -> None:
    """ValueError naming an option a hybrid model (a recurrent state per sequence) cannot serve yet:
    drafts would advance the conv state past tokens that may be rejected (no rollback), LoRA has no
    adapters for the conv (or DeltaNet) layers, and GGUF blocks are planned under transformers' names, which
    LFM2's differ from."""
    if config.speculative is not None:
        raise ValueError("speculative decoding is not supported for hybrid models (a conv state per sequence "
                         "cannot roll rejected drafts back)")
    if config.lora is not None:
        raise ValueError("LoRA adapters are not supported for hybrid models (their short-conv, DeltaNet or Mamba2 "
                         "layers)")
    if config.quantization == "gguf":
        raise ValueError("quantization 'gguf' is not supported for hybrid models yet (their GGUF files load "
                         "dequantized: quantization 'none')")
