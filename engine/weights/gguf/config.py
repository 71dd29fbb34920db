"""GGUF metadata -> a transformers config. llama.cpp keeps the model's shape under
`{architecture}.*` keys (llama.block_count, llama.attention.head_count, ...); this maps them onto the
config fields our model classes (engine/models) and transformers read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q

from engine.weights.gguf.errors import GGUFError
from engine.weights.gguf.gemma import gemma_fields
from engine.weights.gguf.lfm2 import lfm2_fields
from engine.weights.gguf.reader import GGUFFile


@dataclass(frozen=True)
class Architecture:
    """How one llama.cpp architecture maps onto ours."""

    hf_class: str  # the config's `architectures` entry (engine/models picks the class by it)
    model_type: str  # transformers' model_type, for AutoConfig.for_model
    permuted_qk: bool  # llama.cpp's converter permuted the Q/K rows (engine/weights/gguf/tensors.py)
    norm_offset: float = 0.0  # what llama.cpp's converter added to every norm weight (Gemma: 1, its 1 + weight)


ARCHITECTURES = {
    "llama": Architecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "mistral": Architecture("MistralForCausalLM", "mistral", permuted_qk=True),
    "qwen2": Architecture("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
    "qwen3": Architecture("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
    "granite": Architecture("GraniteForCausalLM", "granite", permuted_qk=True),  # llama.cpp: Llama's converter
    "olmo2": Architecture("Olmo2ForCausalLM", "olmo2", permuted_qk=False),
    "phi3": Architecture("Phi3ForCausalLM", "phi3", permuted_qk=False),
    "smollm3": Architecture("SmolLM3ForCausalLM", "smollm3", permuted_qk=True),  # llama.cpp: Llama's converter
    "gemma2": Architecture("Gemma2ForCausalLM", "gemma2", permuted_qk=False, norm_offset=1.0),
    "gemma3": Architecture("Gemma3ForCausalLM", "gemma3_text", permuted_qk=False, norm_offset=1.0),
    # mixture of experts (engine/models/moe.py); Mixtral is `llama` with llama.expert_count (MIXTRAL below)
    "qwen3moe": Architecture("Qwen3MoeForCausalLM", "qwen3_moe", permuted_qk=False),
    "qwen2moe": Architecture("Qwen2MoeForCausalLM", "qwen2_moe", permuted_qk=False),
    "olmoe": Architecture("OlmoeForCausalLM", "olmoe", permuted_qk=False),
    "gpt-oss": Architecture("GptOssForCausalLM", "gpt_oss", permuted_qk=False),
    # hybrid: short convolutions and attention (engine/models/lfm2.py; metadata: gguf/lfm2.py)
    "lfm2": Architecture("Lfm2ForCausalLM", "lfm2", permuted_qk=False),
}
MIXTRAL = Architecture("MixtralForCausalLM", "mixtral", permuted_qk=True)  # llama.cpp: Llama's converter
# whether llama.cpp renormalises the top-k routing weights (its build_moe_ffn norm_w), per architecture
_NORM_TOPK = {"qwen3moe": True, "qwen2moe": False, "olmoe": False, "llama": True}
SMOLLM3_NO_ROPE_STEP = 4  # llama.cpp fixes it (no metadata key): layers 4, 8, ... have no RoPE
_PARTIAL_ROTARY = ("phi3",)  # architectures whose rope.dimension_count may be below the head size
# Granite's multipliers: config field <- `granite.*` key (llama.cpp's names; logit_scale divides the logits)
_GRANITE_SCALES = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                   "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}  # fmt: skip
_DTYPE_OF_TYPE = {Q.BF16: "bfloat16", Q.F16: "float16"}
# LongRoPE's factors (llama.cpp's Phi-3 converter writes them as tensors): read into the config, not weights
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def architecture_of(gf: GGUFFile) -> Architecture:
    """The file's architecture; GGUFError naming it (and the supported ones) otherwise."""
    arch = ARCHITECTURES.get(gf.architecture)
    if gf.architecture == "llama" and _optional(gf, "expert_count", 0):
        return MIXTRAL
    if arch is None:
        raise GGUFError(gf.path, f"unsupported architecture {gf.architecture!r} "
                                 f"(supported: {', '.join(ARCHITECTURES)})")  # fmt: skip
    return arch


def hf_config(gf: GGUFFile):
    """A transformers PretrainedConfig for the file (its class from the architecture)."""
    from transformers import AutoConfig

    arch = architecture_of(gf)
    return AutoConfig.for_model(arch.model_type, **config_fields(gf, arch))


def config_fields(gf: GGUFFile, arch: Architecture) -> dict[str, Any]:
    """config.json fields from the metadata (and the tensor list, for vocab size, ties and biases)."""
    hidden = _required(gf, "embedding_length")
    heads = _required(gf, "attention.head_count")
    head_dim = _head_dim(gf, hidden, heads)
    rotary = _rotary_dim(gf, head_dim, arch)
    names = gf.tensor_names()
    fields = {
        "architectures": [arch.hf_class],
        "vocab_size": _vocab_size(gf),
        "hidden_size": hidden,
        "intermediate_size": _required(gf, "feed_forward_length"),
        "num_hidden_layers": _required(gf, "block_count"),
        "num_attention_heads": heads,
        # (lfm2: one entry per layer, 0 for its conv layers: read by lfm2_fields below)
        "num_key_value_heads": heads if gf.architecture == "lfm2" else _optional(gf, "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": _required(gf, "context_length"),
        "rms_norm_eps": float(_required(gf, "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_optional(gf, "rope.freq_base", 10000.0)),
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": gf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gf.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": gf.get("tokenizer.ggml.padding_token_id"),
        "dtype": _float_dtype(gf),
        "torch_dtype": _float_dtype(gf),
        # quantized matrices: `dtype=auto` may serve them in bf16 on a CPU with bf16 instructions
        "tokenmill_quantized": any(t.tensor_type not in (Q.F32, Q.F16, Q.BF16) for t in gf.tensors
                                   if len(t.shape) > 1),
    }
    if arch.model_type == "smollm3":
        fields["no_rope_layers"] = smollm3_no_rope_layers(fields["num_hidden_layers"])
        fields["use_sliding_window"] = False
    if arch.model_type in ("llama", "mistral", "granite", "smollm3"):
        fields["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch.model_type == "granite":
        fields.update({field: float(_required(gf, key)) for field, key in _GRANITE_SCALES.items()})
    if arch.model_type == "mistral":
        fields["sliding_window"] = _optional(gf, "attention.sliding_window", None)
    if arch.model_type == "gpt_oss":  # llama.cpp: sliding and full layers alternate, the sliding ones first
        fields["sliding_window"] = int(_required(gf, "attention.sliding_window"))
        fields["layer_types"] = [("sliding_attention", "full_attention")[i % 2]
                                 for i in range(fields["num_hidden_layers"])]  # fmt: skip
    if arch.model_type == "qwen2":
        fields["use_sliding_window"] = False
    if rotary != head_dim:
        fields["partial_rotary_factor"] = rotary / head_dim
    scaling = _rope_scaling(gf, rotary, fields["max_position_embeddings"])
    if scaling:
        if scaling["rope_type"] == "longrope":
            fields["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
        fields["rope_scaling"] = scaling
        fields["rope_parameters"] = {**scaling, "rope_theta": fields["rope_theta"]}
    if _optional(gf, "expert_count", 0):
        fields.update(_moe_fields(gf, fields["num_hidden_layers"]))
    if gf.architecture in ("gemma2", "gemma3"):
        fields.update(gemma_fields(gf, fields))  # layer pattern, local RoPE base, soft-caps, attention scale
    if gf.architecture == "lfm2":
        fields.update(lfm2_fields(gf, fields))  # which layers convolve, the conv taps, norm_eps
    return fields


def _moe_fields(gf: GGUFFile, num_layers: int) -> dict[str, Any]:
    """The routing fields of a mixture-of-experts file: expert count and top-k, the experts' width
    (`expert_feed_forward_length`; Mixtral and OLMoE: feed_forward_length), Qwen2-MoE's shared expert,
    and the layers without a router (dense MLPs: Qwen3-MoE's mlp_only_layers; llama.cpp's own files
    have a router on every layer)."""
    experts = int(_required(gf, "expert_count"))
    if gf.architecture == "gpt-oss":  # every layer sparse, top-k softmax over the chosen logits (no key for it)
        return {"num_local_experts": experts, "num_experts_per_tok": int(_required(gf, "expert_used_count")),
                "intermediate_size": int(_optional(gf, "expert_feed_forward_length", 0) or
                                         _required(gf, "feed_forward_length"))}  # fmt: skip
    fields: dict[str, Any] = {
        "num_local_experts" if gf.architecture == "llama" else "num_experts": experts,
        "num_experts_per_tok": int(_required(gf, "expert_used_count")),
        "norm_topk_prob": _NORM_TOPK[gf.architecture],
    }
    if gf.architecture in ("qwen3moe", "qwen2moe"):
        fields["moe_intermediate_size"] = int(_required(gf, "expert_feed_forward_length"))
        fields["decoder_sparse_step"] = 1
        names = gf.tensor_names()
        fields["mlp_only_layers"] = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
        fields["use_sliding_window"] = False
    if gf.architecture == "qwen2moe":
        fields["shared_expert_intermediate_size"] = int(_required(gf, "expert_shared_feed_forward_length"))
    return fields


def smollm3_no_rope_layers(num_layers: int) -> list[int]:
    """transformers' no_rope_layers (1: RoPE) for llama.cpp's fixed step."""
    return [int((i + 1) % SMOLLM3_NO_ROPE_STEP != 0) for i in range(num_layers)]


def _required(gf: GGUFFile, suffix: str) -> Any:
    value = _optional(gf, suffix, None)
    if value is None:
        raise GGUFError(gf.path, f"metadata {gf.architecture}.{suffix} is missing")
    return value


def _optional(gf: GGUFFile, suffix: str, default: Any) -> Any:
    key = f"{gf.architecture}.{suffix}"
    if key in gf.array_lengths:  # per-layer values (hybrid / sliding-window-pattern models)
        raise GGUFError(gf.path, f"metadata {key} differs per layer, which tokenmill does not support")
    value = gf.get(key, default)
    if isinstance(value, bool) or (value is not None and not isinstance(value, (int, float))):
        raise GGUFError(gf.path, f"metadata {key} is {value!r}, expected a number")
    return value


def _head_dim(gf: GGUFFile, hidden: int, heads: int) -> int:
    head_dim = _optional(gf, "attention.key_length", None) or hidden // heads
    value_dim = _optional(gf, "attention.value_length", head_dim)
    if value_dim != head_dim:
        raise GGUFError(gf.path, f"key length {head_dim} != value length {value_dim}: not supported")
    return int(head_dim)


def _rotary_dim(gf: GGUFFile, head_dim: int, arch: Architecture) -> int:
    rotary = int(_optional(gf, "rope.dimension_count", head_dim))
    if rotary != head_dim and (arch.model_type not in _PARTIAL_ROTARY or rotary > head_dim or rotary % 2):
        raise GGUFError(gf.path, f"rotary over {rotary} of {head_dim} head dimensions (partial rotary): "
                                 "not supported")  # fmt: skip
    return rotary


def _vocab_size(gf: GGUFFile) -> int:
    """Rows of the embedding matrix (GGUF shapes list the fastest axis first: [hidden, vocab])."""
    embed = next((t for t in gf.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFError(gf.path, "tensor token_embd.weight is missing")
    return int(embed.shape[-1])


def _float_dtype(gf: GGUFFile) -> str:
    """The checkpoint dtype `dtype="auto"` resolves from: bf16/f16 when every matrix is stored so,
    float32 for float32 and for quantized files (dequantized values need float32 to stay exact)."""
    types = {t.tensor_type for t in gf.tensors if len(t.shape) > 1}
    return _DTYPE_OF_TYPE.get(types.pop(), "float32") if len(types) == 1 else "float32"


def _rope_scaling(gf: GGUFFile, rotary: int, context: int) -> dict[str, Any] | None:
    if "rope_freqs.weight" in gf.tensor_names():
        raise GGUFError(gf.path, "tensor rope_freqs.weight (Llama 3 rope frequency factors) is not supported")
    if any(name in gf.tensor_names() for name in LONGROPE_TENSORS):
        return _longrope(gf, rotary, context)
    kind = gf.get(f"{gf.architecture}.rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_required(gf, "rope.scaling.factor"))}
    if kind == "yarn" and gf.architecture == "gpt-oss":
        # GPT-OSS's YaRN: llama.cpp's default betas (32, 1), no truncation (the checkpoints' truncate false)
        return {"rope_type": "yarn", "factor": float(_required(gf, "rope.scaling.factor")),
                "original_max_position_embeddings": int(_required(gf, "rope.scaling.original_context_length")),
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}  # fmt: skip
    raise GGUFError(gf.path, f"rope scaling {kind!r} is not supported (supported: none, linear; yarn for gpt-oss)")


def _longrope(gf: GGUFFile, rotary: int, context: int) -> dict[str, Any]:
    """Phi-3's LongRoPE as llama.cpp's converter writes it: rope_factors_long/short.weight (float32,
    rotary / 2 values each), {arch}.rope.scaling.original_context_length, and
    {arch}.rope.scaling.attn_factor, its formula of context_length / original: left to transformers'
    default (the same formula in float64) unless the file's value is another one."""
    if gf.architecture not in _PARTIAL_ROTARY:
        raise GGUFError(gf.path, f"LongRoPE factor tensors in a {gf.architecture} file: only phi3 has them")
    by_name = {t.name: t for t in gf.tensors}
    factors = {}
    for name in LONGROPE_TENSORS:
        if name not in by_name:
            raise GGUFError(gf.path, f"tensor {name} is missing (LongRoPE has both factor tensors)")
        values = np.asarray(by_name[name].data, dtype=np.float32).reshape(-1)
        if by_name[name].tensor_type != Q.F32 or values.size != rotary // 2:
            raise GGUFError(gf.path, f"tensor {name}: expected {rotary // 2} float32 values (rotary dims / 2)")
        factors[name] = [float(v) for v in values]
    original = int(_required(gf, "rope.scaling.original_context_length"))
    rope: dict[str, Any] = {"rope_type": "longrope", "long_factor": factors[LONGROPE_TENSORS[0]],
                            "short_factor": factors[LONGROPE_TENSORS[1]], "original_max_position_embeddings": original}
    scale = context / original
    default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    attn = _optional(gf, "rope.scaling.attn_factor", None)
    if attn is not None and np.float32(attn) != np.float32(default):
        rope["attention_factor"] = float(attn)
    return rope
