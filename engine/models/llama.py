"""Llama (and Mistral) decoder over the paged KV cache. Qwen2/Qwen3 subclass it in their own files.

Shapes: T = tokens packed in this step (all sequences), H = query heads, Hkv = KV heads, D = head_dim.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.models.fused_decode import FusedDecode
from engine.models.layers import (
    ForwardContext,
    GatedMLP,
    RMSNorm,
    apply_rotary,
    rotate_,
    rotate_partial,
)
from engine.models.moe import ExpertSlot, MoeExperts, expert_destination, expert_missing
from engine.models.packed_linear import PackedLinear, pack_linears
from engine.models.rope import check_rope_supported, rotary_dim_of, rotary_embedding
from engine.models.windows import layer_groups, layer_windows
from engine.state.conv_cache import ConvStateSpec
from engine.state.delta_cache import DeltaStateSpec
from engine.state.ssm_cache import SsmStateSpec

log = logging.getLogger("tokenmill.engine")


class LlamaAttention(nn.Module):
    qkv_bias = False  # Qwen2: True
    qk_norm = False  # Qwen3: True

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        self.scale = self.attention_scale(cfg)
        self.rotary_dim = rotary_dim_of(cfg, self.head_dim)  # < head_dim: partial rotary (Phi-4-mini)
        self.use_rope = True  # False: a NoPE layer (SmolLM3)
        # sliding window of this layer (None: full attention; models/windows.py reads the config) and the
        # attention-logit soft-cap (None: none; a subclass sets it from its config, Gemma 2)
        self.window: int | None = layer_windows(cfg)[layer_idx]
        # its KV-cache group (engine/kv/groups.py): which block tables and slots it reads (ctx.group_metas)
        self.kv_group: int = layer_groups(cfg)[layer_idx]
        self.softcap: float | None = None
        # learned attention sinks [heads] (GPT-OSS: engine/models/gpt_oss.py), passed to the backends; None: none
        self.sinks: nn.Parameter | None = None
        bias = self.qkv_bias or bool(getattr(cfg, "attention_bias", False))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=bool(getattr(cfg, "attention_bias", False)))
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.fused_rotary = False  # the C++ kernel in place (use_cpu_kernels)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, (q_size, kv_size, _) = x.shape[0], self.split
        lora = ctx.lora.layer(self.layer_idx) if ctx.lora is not None else None
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        if lora is not None:
            qkv = lora.add("qkv", x, qkv)
        v = qkv[:, q_size + kv_size :].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = self.query_key(qkv, ctx)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        meta = ctx.group_metas[self.kv_group] if ctx.group_metas else ctx.meta
        o = ctx.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, self.window,
                                self.softcap, self.sinks).reshape(t, -1)  # [T, H D]
        return self.o_proj(o) if lora is None else lora.add("o", o, self.o_proj(o))

    def attention_scale(self, cfg) -> float:
        """The factor on q.k (Granite: its attention_multiplier)."""
        return self.head_dim**-0.5

    def query_key(self, qkv: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, Hkv, D] out of the fused product, normed and rotated as the model asks."""
        t, (q_size, kv_size, _) = qkv.shape[0], self.split
        if self.qk_norm:
            q = self.q_norm(qkv[:, :q_size].view(t, self.num_heads, self.head_dim))  # [T, H, D]
            k = self.k_norm(qkv[:, q_size : q_size + kv_size].view(t, self.num_kv_heads, self.head_dim))
            return self.rotate(q, k, ctx)
        # q and k sit side by side in qkv: one RoPE over [T, H + Hkv, D] halves the elementwise ops.
        qk = qkv[:, : q_size + kv_size].view(t, -1, self.head_dim)
        if not self.use_rope:
            return qk[:, : self.num_heads], qk[:, self.num_heads :]
        if self.rotary_dim < self.head_dim:
            qk = rotate_partial(qk, ctx.cos, ctx.sin, self.rotary_dim)
        else:
            qk = rotate_(qk, ctx.cos, ctx.sin, self.fused_rotary)
        return qk[:, : self.num_heads], qk[:, self.num_heads :]

    def rotate(self, q: torch.Tensor, k: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q and k kept apart (after a norm), honouring NoPE layers and partial rotary."""
        if not self.use_rope:
            return q, k
        if self.rotary_dim < self.head_dim:
            return (rotate_partial(q, ctx.cos, ctx.sin, self.rotary_dim),
                    rotate_partial(k, ctx.cos, ctx.sin, self.rotary_dim))  # fmt: skip
        return apply_rotary(q, k, ctx.cos, ctx.sin)


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, layer_idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=bool(getattr(cfg, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output (the embeddings at layer 0), residual: the stream it adds
        to (None at layer 0). Returns this layer's MLP output and the stream before it; adding the
        two is left to the next norm, which can fuse the add."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(positions, h, ctx)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        lora = ctx.lora.layer(self.self_attn.layer_idx) if ctx.lora is not None else None
        return self.mlp(h, lora), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, layer_cls: type[LlamaDecoderLayer], max_positions: int) -> None:
        super().__init__()
        check_rope_supported(cfg, max_positions)
        self.rotary = rotary_embedding(cfg, head_dim_of(cfg), max_positions)  # LongRoPE: its pair of tables
        # Granite scales the embeddings; 1.0 elsewhere (no multiply then)
        self.embedding_multiplier = float(getattr(cfg, "embedding_multiplier", 1.0) or 1.0)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fused_decode: FusedDecode | None = None  # the C++ layer loop for decode steps (use_cpu_kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed(input_ids), None  # [T, hidden]
        self.set_rotary(positions, ctx)
        fused = self.fused_decode.run(x, ctx) if self.fused_decode is not None else None
        if fused is not None:
            x, residual = fused
        else:
            for layer in self.layers:
                x, residual = layer(positions, x, residual, ctx)
        return self.norm.add_norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, hidden], scaled as the model asks (Granite's multiplier; Gemma's
        sqrt(hidden) in gemma.py)."""
        x = self.embed_tokens(input_ids)
        return x * self.embedding_multiplier if self.embedding_multiplier != 1.0 else x

    def set_rotary(self, positions: torch.Tensor, ctx: ForwardContext) -> None:
        """The step's rotary tables into ctx (Gemma 3 adds its local layers' own)."""
        ctx.cos, ctx.sin = self.rotary.lookup(positions, ctx.rope_long)


class LlamaForCausalLM(nn.Module):
    layer_cls = LlamaDecoderLayer
    model_cls = LlamaModel  # the decoder stack (Gemma: its embedding scale, norms and rotary tables)
    # checkpoint sub-name -> (our fused param, shard index); shards are laid out in this order.
    packed = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        self.check_config(cfg)
        self.config = cfg
        self.model = self.model_cls(cfg, self.layer_cls, max_positions)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        # Tied: None, the logits reuse the embedding matrix (until pack_weights gives it a packed copy).
        self.lm_head: nn.Module | None = None
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def check_config(self, cfg) -> None:
        """ValueError naming a config key this class cannot serve (before any weight is read)."""
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported (the MLP is SwiGLU: silu)")

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states after the final norm: [T, hidden]."""
        return self.model(input_ids, positions, ctx)

    @property
    def rope_switch(self) -> int | None:
        """LongRoPE's switch position (original_max_position_embeddings): the model runner marks the
        tokens below it of sequences longer than it (ForwardContext.rope_long), the engine core computes
        a sequence again when it grows past it, and the prefix cache keeps the two sides apart; None for
        every other rope type."""
        return self.model.rotary.switch

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> logits [N, vocab] in the model dtype (the sampler upcasts when it needs to)."""
        if self.lm_head is None:
            return torch.nn.functional.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

    def fused_decode_unsupported(self) -> str | None:
        """Why the C++ decode loop (engine/kernels/csrc/cpu_decode.cpp: pre-norm layers, full RoPE on
        every layer, Q/K norms per head, scale 1 on the residual branches, sliding windows per layer but
        no attention-logit soft-cap) cannot run this model;
        None when it can. A subclass whose math differs says so here, and keeps the Python layers."""
        attn = self.model.layers[0].self_attn
        if attn.rotary_dim < attn.head_dim:
            return f"partial rotary ({attn.rotary_dim} of {attn.head_dim} dims)"
        if any(layer.self_attn.softcap is not None for layer in self.model.layers):
            return "attention-logit soft-capping"
        if self.attention_sinks:
            return "attention sinks"
        return None

    def cuda_graphs_unsupported(self) -> str | None:
        """Why decode steps of this model cannot be captured in CUDA graphs; None when they can."""
        if any(layer.self_attn.kv_group for layer in self.model.layers):
            # the graphs' persistent decode buffers hold one block table per row (engine/runner/cuda_graphs.py)
            return "KV-cache groups (sliding and full layers read their own block tables)"
        return None

    @property
    def attention_sinks(self) -> bool:
        """Whether the attention layers have learned sinks (the backend must take them: engine/engine.py)."""
        # (every attention module: a hybrid model's recurrent layers have none)
        return any(m.sinks is not None for m in self.modules() if isinstance(m, LlamaAttention))

    # ---- hybrid models (engine/models/lfm2.py): recurrent layers beside the attention ones -------------
    hybrid = False  # True: some layers keep a per-sequence state (conv_state_spec), not KV blocks

    def conv_state_spec(self, dtype: torch.dtype) -> ConvStateSpec | None:
        """The per-sequence conv state of this model's recurrent layers (engine/state/); None: every layer
        is attention, the model keeps nothing but KV blocks."""
        return None

    def delta_state_spec(self) -> DeltaStateSpec | None:
        """The per-sequence recurrent matrices of this model's Gated DeltaNet layers (Qwen3.5:
        engine/models/qwen35.py; engine/state/delta_cache.py), in the same slots as the conv state; None: none."""
        return None

    def ssm_state_spec(self) -> SsmStateSpec | None:
        """The per-sequence SSM matrices of this model's Mamba2 layers (engine/state/ssm_cache.py, Granite 4),
        in the same slots as its conv windows; None: no such layers."""
        return None

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep KV blocks (a hybrid model's attention layers only); each attention layer's
        entry of ForwardContext.kv_caches is its index among them."""
        return len(self.model.layers)

    def use_cpu_kernels(self, norms: bool, fused_decode: bool = True) -> None:
        """Route rotary (and, with norms, every RMSNorm and residual add) through the C++ CPU
        kernels (engine/kernels/cpu_kernels.py, loaded by the caller). Rotary is bit-exact in any dtype;
        the norms' float32 mean sums in another order than PyTorch's, so they are for bf16 only.
        With fused_decode, decode-only steps run the layer loop in C++ (models/fused_decode.py); call
        it after the linears are final (pack_weights / replace_linears)."""
        for mod in self.modules():
            if isinstance(mod, LlamaAttention):
                mod.fused_rotary = True
            elif isinstance(mod, RMSNorm):
                mod.fused = norms and mod.fusable
        if not fused_decode:
            return
        why_not = self.fused_decode_unsupported()
        if why_not is not None:
            log.info("fused decode: off for %s (%s): decode steps run the Python layers",
                     type(self).__name__, why_not)  # fmt: skip
            return
        if not FusedDecode.available():
            # a model the loop implements, without its kernels: TOKENMILL_REQUIRE_KERNELS=1 refuses the fallback
            from engine.kernels import cpu_kernels

            if cpu_kernels.required():
                raise cpu_kernels.KernelsUnavailable(
                    f"fused decode unavailable for {type(self).__name__} (its kernel groups did not load) "
                    "and TOKENMILL_REQUIRE_KERNELS=1")
            log.info("fused decode: off for %s (kernels not loaded): decode steps run the Python layers",
                     type(self).__name__)  # fmt: skip
            return
        self.model.fused_decode = FusedDecode(self.model.layers)
        log.info("fused decode: on for %s (decode steps run the C++ layer loop)", type(self).__name__)

    def pack_weights(self, batch_hint: int) -> int:
        """Every linear, the logits projection included, to oneDNN's packed layout (CPU bf16; see
        packed_linear.py). A tied model's packed head is a copy: the embedding lookup keeps the
        row-major matrix. Returns the number of packed matrices."""
        n = pack_linears(self, batch_hint)
        if self.lm_head is None:
            self.lm_head = PackedLinear(self.model.embed_tokens.weight, None, batch_hint)
            n += 1
        return n

    def replace_linears(self, make) -> None:
        """Every linear, the logits head included, by make(weight, bias, role) (CPU kernels, INT8:
        engine/weights/cpu_weights.py). role: "gate_up" for each gated MLP's fused gate/up weight (a module
        with silu_mul(x) returned there computes silu(gate) * up itself, and the MLP calls it),
        "lm_head" for the logits head (a tied model's is built from the embedding matrix; the lookup
        keeps its own), "linear" for the rest; a mixture-of-experts model's experts each get theirs
        (gate_up, linear; engine/models/moe.py)."""
        for mlp in [m for m in self.modules() if isinstance(m, GatedMLP) and m.activation == "silu"]:
            lin = mlp.gate_up_proj
            mlp.gate_up_proj = make(lin.weight, lin.bias, "gate_up")
            mlp.fused_act = hasattr(mlp.gate_up_proj, "silu_mul")
        for experts in [m for m in self.modules() if isinstance(m, MoeExperts)]:  # each expert's, same roles
            experts.replace_linears(make)
        targets = [(parent, name, child) for parent in self.modules() for name, child in parent.named_children()
                   if isinstance(child, nn.Linear)]
        for parent, name, child in targets:
            setattr(parent, name, make(child.weight, child.bias, "lm_head" if child is self.lm_head else "linear"))
        if self.lm_head is None:
            self.lm_head = make(self.model.embed_tokens.weight, None, "lm_head")

    def shard_sizes(self, fused: str, rows: int | None = None) -> list[int]:
        """Row sizes of the shards of a fused parameter of `rows` rows (None: a dense layer's), in shard
        order. gate_up halves: a MoE model's shared expert is not intermediate_size wide."""
        if fused == "qkv_proj":
            return self.model.layers[0].self_attn.split
        inter = self.config.intermediate_size if rows is None else rows // 2
        return [inter, inter]

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as this class names its parameter (Mixtral renames its MLP)."""
        return name

    def expert_slot(self, name: str) -> ExpertSlot | None:
        """Where a (renamed) checkpoint tensor of stacked experts goes; None: not an expert weight
        (mixture-of-experts classes, engine/models/moe.py)."""
        return None

    def expert_destination(self, param: torch.Tensor, slot: ExpertSlot) -> torch.Tensor:
        """The view of a stacked expert parameter that a checkpoint tensor of `slot` fills (GPT-OSS: its own)."""
        return expert_destination(param, slot)

    def expert_missing(self, param: str, shape: torch.Size, loaded: set[str]) -> list[str]:
        """The loaded-key tags of a stacked expert parameter not yet loaded (engine/models/moe.py)."""
        return expert_missing(param, shape, loaded)

    def after_load(self, dtype: torch.dtype, device: torch.device) -> None:
        """Build tables that are not weights (rotary cos/sin)."""
        self.model.rotary.build(dtype, device)


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
