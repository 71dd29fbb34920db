"""The engine with its model: loads the weights, sizes the KV cache, builds the model runner, and hands
them to `StepLoop` (engine/core/step_loop.py), which does everything else (schedule, run, update)."""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time

import torch

from engine.api.errors import LoraError
from engine.attention import select_backend
from engine.config import EngineConfig
from engine.config.engine_config import resolve_step_budget
from engine.core.step_loop import GenerationResult, StepLoop
from engine.core.thread_count import ThreadPin, per_thread_setter
from engine.core.thread_governor import GovernorConfig, ThreadGovernor
from engine.kernels import cpu_kernels
from engine.kv.block_manager import BlockManager
from engine.kv.cache import allocate_kv_cache
from engine.kv.events import KVEventSink
from engine.lora.loading import make_registry
from engine.models import batch_invariant
from engine.models.moe import MoeCausalLM
from engine.models.windows import layer_windows, uniform_window
from engine.runner import startup
from engine.runner.cuda_graphs import capture_graphs, graph_buckets, graphs_enabled
from engine.runner.model_runner import ModelRunner
from engine.runner.profiling import activation_peak_bytes
from engine.sample.sampler import Sampler
from engine.sched.scheduler import SchedulerConfig
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
        blocks = blocks_for(source, config.quantization, self.device)  # GGUF matrices kept quantized
        model = load_model(source, self.dtype, self.device, self.max_model_len, config.show_progress,
                           frozenset(blocks.held) if blocks else frozenset())
        # packing, kernels, INT8, GGUF blocks
        self.weights = prepare_weights(model, config, self.device, self.dtype, ggml=blocks.weights if blocks else None,
                                       ggml_text=blocks.describe() if blocks else "gguf")
        self.packed_weights = self.weights.packed
        if isinstance(model, MoeCausalLM):  # the experts' path on CUDA (Triton grouped GEMM or the loop)
            log.info("MoE experts: %s", model.select_experts(self.device, self.dtype, cpu_kernels.required()))
        backend = select_backend(self.device, config.attention_backend, self.dtype)
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
        spec = startup.kv_spec(self.hf_config, self.block_size, self.dtype)
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            cuda_profile = self.device.type == "cuda" and config.kv_cache_memory is None
            peak = activation_peak_bytes(model, backend, spec, self.device, min(budget, self.max_model_len),
                                         config.max_num_seqs, buckets[-1] if use_graphs else 0) if cuda_profile else 0
            num_blocks = spec.num_blocks_for(startup.kv_budget_bytes(config, self.device, peak))
        if num_blocks < 1:
            raise ValueError("kv_cache_memory is too small for one KV block")
        rows_kernel = backend.name == "cpu" and cpu_kernels.load("sampling") is None
        self.sampler = Sampler(config.seed, rows_kernel=rows_kernel)
        kv = allocate_kv_cache(spec, num_blocks, self.device, backend)
        self.kv_cache_bytes = num_blocks * spec.bytes_per_block
        graphs = capture_graphs(model, backend, kv, buckets, self.block_size, self.max_model_len,
                                self.device) if use_graphs else None
        loras = make_registry(config.lora, self.hf_config, self.device, self.dtype) if config.lora else None
        super().__init__(
            model_name=source.name,
            tokenizer=source.tokenizer,
            runner=ModelRunner(model, kv, backend, self.block_size, self.device, self.sampler, graphs, loras,
                               one_row_attention=config.deterministic),
            block_manager=BlockManager(num_blocks, self.block_size, config.enable_prefix_caching,
                                       record_events=kv_event_sink is not None,
                                       event_hash_salt=secrets.randbits(64),
                                       sliding_window=uniform_window(self.hf_config),
                                       rope_switch=getattr(model, "rope_switch", None)),
            scheduler_config=SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.aging_s,
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
        windows = [w for w in layer_windows(self.hf_config) if w is not None]
        if windows:  # which layers attend through a window, and whether out-of-window blocks are freed
            log.info("sliding window: %s tokens on %d of %d layers; KV blocks that left it: %s", max(windows),
                     len(windows), len(layer_windows(self.hf_config)),
                     "freed" if self.scheduler.blocks.sliding_window is not None
                     else "kept (full-attention layers read them)")  # fmt: skip
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
