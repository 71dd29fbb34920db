"""`EngineConfig`, the engine's settings: frozen, validated, no I/O in the constructor; and the choices
of its options that other packages implement (each list names the module that reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config.lora import LoraConfig
from engine.config.speculative import SpeculativeConfig

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")  # engine.attention.select_backend
GRAMMAR_BACKENDS = ("xgrammar", "none")  # engine.structured.make_compiler
QUANTIZATIONS = (None, "int8", "gguf", "none")  # engine/models/quantization.py, gguf_linear.py
GGUF_ACTIVATIONS = ("mixed", "int8", "float")  # engine/models/gguf_linear.py, engine/weights/cpu_weights.py
CPU_GEMV = ("auto", "on", "off")  # engine/weights/cpu_weights.py


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the model's own config (config.json or GGUF metadata)."""

    model: str  # a Hugging Face folder, a .gguf file, or a folder holding one .gguf (engine/weights/model_open.py)
    dtype: str = "auto"  # auto: the checkpoint's torch_dtype on CUDA; CPU: bf16 for a bf16 checkpoint, or a quantized GGUF on a bf16 CPU, else float32
    device: str = "auto"  # auto: cuda when available, else cpu
    block_size: int | None = None  # tokens per KV block; None: 32 on CPU (cheaper gathers), 16 on CUDA
    kv_cache_memory: int | None = None  # bytes of KV cache (CPU default 1 GiB; on CUDA overrides utilization)
    num_kv_blocks: int | None = None  # exact number of KV blocks; overrides both budgets (tests, tuning)
    gpu_memory_utilization: float = 0.9  # fraction of device memory the process may use (CUDA only)
    max_num_seqs: int = 64  # most requests running at once
    max_num_batched_tokens: int | None = None  # token budget of one step (decodes + prefill chunks); None: 512 CPU, 2048 CUDA
    aging_s: float = 60.0  # a waiting request gains one priority level per this many seconds (0: off); docs/ENGINE.md
    # Fair share between tenants inside a priority (engine/sched/fair_share.py): weights by tenant name (others 1),
    # and whether a tenant under its share of max_num_seqs takes a seat from one over its own in the same lane
    tenant_weights: tuple[tuple[str, float], ...] = ()
    fair_seats: bool = True
    # a prompt chunk of a request outranked by another in the same step: at most this many tokens (None: no cap)
    outranked_chunk_tokens: int | None = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # a hybrid model's state checkpoints, its prefix reuse (engine/state/checkpoint_store.py): None: sized from
    # the cache budget (at most a tenth; 4 per seat with num_kv_blocks); 0: off (it then reuses no prefix)
    num_state_checkpoints: int | None = None
    seed: int = 0  # seed of the engine's default generator (requests without a seed)
    show_progress: bool = True  # progress bar while loading weights
    attention_backend: str = "auto"  # auto: Triton kernels on CUDA, C++ kernels on CPU, when they run; else torch
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (CUDA only; the CPU never uses them)
    pack_weights: bool = True  # CPU bf16: linear weights in oneDNN's packed layout (same results, faster)
    tokenizer: str | None = None  # a Hugging Face tokenizer folder used instead of the model's own
    grammar_backend: str = "xgrammar"  # structured outputs and enforced tool calls; "none": refused (400)
    grammar_cache_bytes: int = 256 << 20  # compiled grammars kept (bytes); a grammar over this alone is refused
    # compile grammars in worker processes, so a compile past its budget is killed (the server does);
    # False: on the caller's thread (offline use, tests)
    grammar_compile_processes: bool = False
    # None or "none": every weight in dtype (GGUF dequantized); "gguf" (opt-in): a GGUF file's Q4_0 / Q4_1 /
    # Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K matrices kept quantized (CPU kernels; CUDA: Triton), or an error
    # where it cannot apply; "int8": INT8 weight-only linears (CPU; half the weight bytes)
    quantization: str | None = None
    # "gguf" blocks: the kernels' activations, "int8" (quantized per 32 values, integer dot products, as
    # llama.cpp: faster, within a stated bound of the float product), "float" (float32, bit-exact reference)
    # or "mixed" (int8, but float for the MLP's down projection, whose input, the gated product, carries the
    # outliers that int8 units lose: measured closer to the float model, docs/ENGINE.md)
    gguf_activations: str = "mixed"
    # INT8 input columns per scale of an output row; None, or a weight whose K it does not divide: one scale per row.
    quantization_group_size: int | None = 64
    cpu_gemv: str = "auto"  # CPU small-batch linear kernels: auto (bf16/INT8: where measured faster at start-up; float32: up to 32 rows), on, off
    fused_decode: bool = True  # CPU kernels: decode-only steps run the layer loop in C++ (same results, less overhead)
    cpu_threads: int | None = None  # CPU: torch's intra-op threads, set at start-up (process-wide); None: torch's
    # CPU, more than one thread: steps drop to one thread while that is measured faster (another process
    # holds a core) and come back when it no longer is (engine/core/thread_governor.py; the switch sets the
    # stepping thread's count only, engine/core/thread_count.py). Off in the batch-invariant mode.
    adaptive_threads: bool = True
    # Speculative decoding (vLLM's --speculative-config; a dict of its keys is accepted); None: off
    speculative: SpeculativeConfig | None = None
    # LoRA adapters (engine/lora/; vLLM's --enable-lora and friends); None: off
    lora: LoraConfig | None = None
    # Batch-invariant mode (engine/models/batch_invariant.py): each row's result independent of the batch, its
    # position, chunking, prefix-cache hits and preemption; CPU only, a few percent slower; False: unchanged
    deterministic: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict):
            object.__setattr__(self, "speculative", SpeculativeConfig.from_dict(self.speculative))
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a SpeculativeConfig, a dict or None, got {self.speculative!r}")
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ValueError(f"lora must be a LoraConfig or None, got {self.lora!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty path")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES} or cuda:N, got {self.device!r}")
        if self.block_size is not None:
            _positive("block_size", self.block_size)
        if self.kv_cache_memory is not None:
            _positive("kv_cache_memory", self.kv_cache_memory)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _positive("max_num_seqs", self.max_num_seqs)
        if self.num_state_checkpoints is not None and (isinstance(self.num_state_checkpoints, bool) or not
                                                       isinstance(self.num_state_checkpoints, int) or
                                                       self.num_state_checkpoints < 0):  # fmt: skip
            raise ValueError(f"num_state_checkpoints must be an integer >= 0 or None, got {self.num_state_checkpoints!r}")
        if self.max_num_batched_tokens is not None:
            _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.outranked_chunk_tokens is not None:
            _positive("outranked_chunk_tokens", self.outranked_chunk_tokens)
        if isinstance(self.aging_s, bool) or not isinstance(self.aging_s, (int, float)) or not self.aging_s >= 0:
            raise ValueError(f"aging_s must be a number >= 0, got {self.aging_s!r}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ValueError("tokenizer must be a non-empty path or None")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}")
        _positive("grammar_cache_bytes", self.grammar_cache_bytes)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(f"gguf_activations must be one of {GGUF_ACTIVATIONS}, got {self.gguf_activations!r}")
        if self.cpu_threads is not None:
            _positive("cpu_threads", self.cpu_threads)
        if self.quantization_group_size is not None:
            _positive("quantization_group_size", self.quantization_group_size)
            if self.quantization_group_size % 2:
                raise ValueError(f"quantization_group_size must be even, got {self.quantization_group_size}")
        if self.cpu_gemv not in CPU_GEMV:
            raise ValueError(f"cpu_gemv must be one of {CPU_GEMV}, got {self.cpu_gemv!r}")
        for name in ("enforce_eager", "pack_weights", "fused_decode", "grammar_compile_processes", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def resolve_step_budget(tokens: int | None, device: torch.device) -> int:
    """The step's token budget: 512 on CPU, 2048 on CUDA unless given. A CPU step's time grows with
    its tokens (SmolLM2 bf16, one thread: 512 prompt tokens 230 ms, 2048 1.24 s, and no faster per
    token), and every running request's next token waits for the step, an interactive one's too."""
    if tokens is not None:
        return tokens
    return 512 if device.type == "cpu" else 2048
