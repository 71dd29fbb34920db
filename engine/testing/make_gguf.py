"""Write GGUF files from Hugging Face model folders (the seeded make_model presets) the way llama.cpp's
converter lays them out, with `gguf.GGUFWriter`: metadata under `{arch}.*`, a byte-level BPE
tokenizer under `tokenizer.ggml.*`, Q/K rows permuted for llama-family models, 2-D weights in the
requested type (1-D norms and biases stay F32, as llama.cpp keeps them).

    python -m engine.testing.make_gguf FOLDER OUT.gguf --type Q4_1

A matrix whose rows do not split into blocks of the requested type falls back to Q8_0 (32-value
blocks), then F16, as llama.cpp's quantizer does. Q4_K is quantized here (the gguf package only
dequantizes K-quants): plain min/max per 32-value sub-block, good enough for tests.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from engine.weights.gguf.config import ARCHITECTURES, smollm3_no_rope_layers
from engine.weights.gguf.gemma import DEFAULT_PATTERN, LAYERS_27B, pattern_of
from engine.weights.gguf.tensors import ROUTERS, gguf_name, permute

# transformers class -> llama.cpp architecture (its converter writes Mistral as llama)
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "GraniteForCausalLM": "granite", "Olmo2ForCausalLM": "olmo2",
             "Phi3ForCausalLM": "phi3", "SmolLM3ForCausalLM": "smollm3", "Gemma2ForCausalLM": "gemma2",
             "Gemma3ForCausalLM": "gemma3", "Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe",
             "OlmoeForCausalLM": "olmoe", "MixtralForCausalLM": "llama", "GptOssForCausalLM": "gpt-oss",
             "Lfm2ForCausalLM": "lfm2"}  # fmt: skip
PERMUTED = ("llama", "mistral", "granite", "smollm3")  # architectures whose Q/K rows llama.cpp's converter permutes
TYPES = {q.name: q for q in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K,
                             Q.MXFP4)}  # MXFP4: the experts' stacks only (llama.cpp's MOSTLY_MXFP4_MOE), the rest F32
# A Q4_K_M-like mix (the Gemma 3 270M file's types): matrix role -> type; the embedding Q8_0.
MIX = {"q_proj": Q.Q5_0, "k_proj": Q.Q5_0, "v_proj": Q.Q8_0, "o_proj": Q.Q4_K, "gate_proj": Q.Q5_0,
       "up_proj": Q.Q5_0, "down_proj": Q.Q6_K, "embed_tokens": Q.Q8_0, "lm_head": Q.Q6_K}
_QK_K = 256  # values per K-quant super-block


def _load_float32(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file's tensors as float32 numpy arrays (bf16 ones too: numpy has no bfloat16)."""
    return {k: v.float().numpy() for k, v in load_file(str(path)).items()}


def write_gguf(folder: str | Path, out: str | Path, qtype: str = "F32", arch: str | None = None) -> Path:
    """Write `folder`'s model as a GGUF file at `out` with matrices in `qtype`. Returns `out`.
    `arch` overrides the llama.cpp architecture name (tests of unsupported ones)."""
    folder, out = Path(folder), Path(out)
    if qtype not in TYPES and qtype != "MIX":
        raise ValueError(f"qtype must be one of {sorted([*TYPES, 'MIX'])}, got {qtype!r}")
    config = json.loads((folder / "config.json").read_text())
    name = arch or GGUF_ARCH[config["architectures"][0]]
    if name == "llama" and config["architectures"][0] == "MistralForCausalLM" and config.get("sliding_window"):
        # llama's metadata has no window: a windowed Mistral goes out as `mistral` with
        # mistral.attention.sliding_window (engine/weights/gguf/config.py reads it)
        name = "mistral"
    if name == "smollm3" and config["no_rope_layers"] != smollm3_no_rope_layers(config["num_hidden_layers"]):
        raise ValueError("a smollm3 GGUF file cannot say no_rope_layers other than llama.cpp's every 4th layer")
    writer = gguf.GGUFWriter(str(out), name)
    _add_model_metadata(writer, config, folder.name)
    if config.get("num_experts") or config.get("num_local_experts"):
        _add_moe_metadata(writer, config, name)
    if name in DEFAULT_PATTERN:
        _add_gemma_metadata(writer, config, name)
    if name == "lfm2":
        _add_lfm2_metadata(writer, config)
    norm_offset = ARCHITECTURES[name].norm_offset if name in ARCHITECTURES else 0.0  # Gemma's 1 + weight
    _add_tokenizer(writer, folder, config["vocab_size"])
    for tensor, factors in _longrope_tensors(writer, config).items():
        writer.add_tensor(tensor, factors)
    permuted = name in PERMUTED
    tensors = _load_float32(folder / "model.safetensors")
    if name == "gpt-oss":
        _add_gpt_oss_metadata(writer, config)
        tensors = gpt_oss_tensors(tensors)
    for hf, value in stack_experts(tensors).items():
        value = value.astype(np.float32)
        if hf.endswith(ROUTERS):  # llama.cpp keeps routers in F32, the shared expert's gate a vector [H]
            writer.add_tensor(gguf_name(hf, name), value.reshape(-1) if "shared_expert_gate" in hf else value)
            continue
        if norm_offset and hf.endswith("norm.weight"):
            value = value + np.float32(norm_offset)
        if hf.endswith(".conv.conv.weight"):  # LFM2's conv, squeezed as llama.cpp's converter does: [hidden, L]
            value = value.reshape(value.shape[0], -1)
        if permuted and (".q_proj." in hf or ".k_proj." in hf):
            heads = config["num_attention_heads"] if ".q_proj." in hf else config["num_key_value_heads"]
            value = permute(value, heads)
        # biases stay F32 (GPT-OSS's experts' biases are [E, rows]: not matrices)
        data, raw = encode(value, type_of(hf, qtype) if value.ndim > 1 and not hf.endswith(".bias") else Q.F32)
        writer.add_tensor(gguf_name(hf, name), data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def type_of(hf: str, qtype: str) -> Q:
    """The type a matrix named `hf` is written in for `qtype` (MIX: by its role; MXFP4: experts only)."""
    if qtype == "MXFP4":
        return Q.MXFP4 if ".experts." in hf else Q.F32
    if qtype != "MIX":
        return TYPES[qtype]
    return next((t for role, t in MIX.items() if f"{role}." in hf), Q.Q8_0)
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_MATRIX = {"gate_proj": "gate_proj", "w1": "gate_proj", "up_proj": "up_proj", "w3": "up_proj",
                  "down_proj": "down_proj", "w2": "down_proj"}  # fmt: skip


def stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert matrices (`...mlp.experts.3.gate_proj.weight`, Mixtral's `block_sparse_moe...w1`) stacked
    as llama.cpp's converter stacks them: `...mlp.experts.gate_proj.weight` [E, rows, cols]; Mixtral's
    router renamed `mlp.gate`. Other tensors pass as they are, in order."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for hf, value in tensors.items():
        m = _EXPERT.match(hf)
        if m is None:
            out[hf.replace(".block_sparse_moe.", ".mlp.")] = value
            continue
        stacks.setdefault(f"{m.group(1)}.mlp.experts.{_EXPERT_MATRIX[m.group(3)]}.weight", {})[int(m.group(2))] = value
    for hf, by_expert in stacks.items():
        out[hf] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def gpt_oss_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GPT-OSS's checkpoint tensors as llama.cpp's converter splits them: gate_up_proj [E, H, 2I] (gate at
    the even columns) into `experts.gate_proj.weight` / `up_proj.weight` [E, I, H], down_proj [E, I, H]
    transposed to [E, H, I], the biases split the same way; the router as `mlp.gate`, the sinks as
    `self_attn.sinks.weight` (its attn_sinks.weight)."""
    out: dict[str, np.ndarray] = {}
    for hf, value in tensors.items():
        hf = hf.replace(".mlp.router.", ".mlp.gate.")
        base = hf.rsplit(".", 1)[0]
        if hf.endswith(".self_attn.sinks"):
            out[hf + ".weight"] = value
        elif hf.endswith(".experts.gate_up_proj"):
            both = np.ascontiguousarray(value.transpose(0, 2, 1))  # [E, 2I, H]
            out[base + ".gate_proj.weight"], out[base + ".up_proj.weight"] = both[:, 0::2], both[:, 1::2]
        elif hf.endswith(".experts.gate_up_proj_bias"):
            out[base + ".gate_proj.bias"], out[base + ".up_proj.bias"] = value[:, 0::2], value[:, 1::2]
        elif hf.endswith(".experts.down_proj"):
            out[base + ".down_proj.weight"] = np.ascontiguousarray(value.transpose(0, 2, 1))  # [E, H, I]
        elif hf.endswith(".experts.down_proj_bias"):
            out[base + ".down_proj.bias"] = value
        else:
            out[hf] = value
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _add_gpt_oss_metadata(w: gguf.GGUFWriter, c: dict) -> None:
    """The keys llama.cpp's GPT-OSS converter adds: the window, the experts' width, YaRN."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    w.add_sliding_window(int(c["sliding_window"]))
    w.add_expert_feed_forward_length(int(c["intermediate_size"]))
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings", 4096)))


def _add_moe_metadata(w: gguf.GGUFWriter, c: dict, arch: str) -> None:
    """llama.cpp's expert keys; Qwen's expert width and shared expert."""
    w.add_expert_count(int(c.get("num_experts") or c["num_local_experts"]))
    w.add_expert_used_count(int(c["num_experts_per_tok"]))
    if arch in ("qwen3moe", "qwen2moe"):
        w.add_expert_feed_forward_length(int(c["moe_intermediate_size"]))
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(int(c["shared_expert_intermediate_size"]))


def _add_model_metadata(w: gguf.GGUFWriter, c: dict, name: str) -> None:
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rope = c.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type; the global layers' here
    w.add_name(name)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(c["num_attention_heads"])
    if "Lfm2ForCausalLM" not in c["architectures"]:  # (per layer, its MLP width rule, norm_eps: _add_lfm2_metadata)
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_layer_norm_rms_eps(float(c["rms_norm_eps"]))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))  # Phi-4-mini: 3/4
    w.add_rope_freq_base(float(rope.get("rope_theta", c.get("rope_theta", 10000.0))))
    if c.get("sliding_window") and c["architectures"][0] == "MistralForCausalLM":
        w.add_sliding_window(int(c["sliding_window"]))
    w.add_vocab_size(c["vocab_size"])
    if "GraniteForCausalLM" in c["architectures"]:
        w.add_embedding_scale(float(c["embedding_multiplier"]))
        w.add_residual_scale(float(c["residual_multiplier"]))
        w.add_attention_scale(float(c["attention_multiplier"]))
        w.add_logit_scale(float(c["logits_scaling"]))


def _add_lfm2_metadata(w: gguf.GGUFWriter, c: dict) -> None:
    """llama.cpp's LFM2 keys (engine/weights/gguf/lfm2.py), where they differ from the common ones
    (_add_model_metadata leaves those three out): KV heads per layer (0: a conv layer), the conv taps, norm_eps, the MLP width after LFM2's rule."""
    from types import SimpleNamespace

    from engine.models.lfm2 import ATTENTION, lfm2_ff_dim, lfm2_layer_types

    cfg = SimpleNamespace(**c)
    w.add_head_count_kv([c["num_key_value_heads"] if t == ATTENTION else 0 for t in lfm2_layer_types(cfg)])
    w.add_feed_forward_length(lfm2_ff_dim(cfg))
    w.add_layer_norm_rms_eps(float(c["norm_eps"]))
    w.add_shortconv_l_cache(int(c["conv_L_cache"]))


def _longrope_tensors(w: gguf.GGUFWriter, c: dict) -> dict[str, np.ndarray]:
    """A LongRoPE config as llama.cpp's Phi-3 converter writes it: the original context and the attention
    factor (its formula, from context_length / original) as metadata, the factors as two float32
    tensors. {} for other rope types."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) != "longrope":
        return {}
    original = int(rope.get("original_max_position_embeddings") or c["original_max_position_embeddings"])
    scale = c["max_position_embeddings"] / original
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
    return {"rope_factors_long.weight": np.asarray(rope["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.asarray(rope["short_factor"], dtype=np.float32)}


def _add_gemma_metadata(w: gguf.GGUFWriter, c: dict, arch: str) -> None:
    """What llama.cpp's gemma2/gemma3 converter writes, and the optional keys its loader reads where the
    config differs from what it assumes (engine/weights/gguf/gemma.py)."""
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    big = c["num_hidden_layers"] == LAYERS_27B[arch]
    scalar = c["hidden_size"] // c["num_attention_heads"] if big else head_dim
    if c["query_pre_attn_scalar"] != scalar:
        raise ValueError(f"a {arch} GGUF file cannot say query_pre_attn_scalar {c['query_pre_attn_scalar']} "
                         f"(llama.cpp derives {scalar})")  # fmt: skip
    if c.get("sliding_window"):
        w.add_sliding_window(int(c["sliding_window"]))
        pattern = pattern_of(c["layer_types"], arch)
        if pattern is not None:
            w.add_sliding_window_pattern(pattern)
    if c.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(c["final_logit_softcapping"]))
    if arch == "gemma2":
        w.add_attn_logit_softcapping(float(c.get("attn_logit_softcapping") or 0.0))
        return
    rope = c["rope_parameters"]
    if float(rope["sliding_attention"]["rope_theta"]) != 10000.0:
        w.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
    full = rope["full_attention"]
    if full.get("rope_type", "default") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(full["factor"]))
    elif full.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {full['rope_type']!r} of the global layers cannot be written")


def _add_tokenizer(w: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"] if t.get("special")}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    for i in range(len(tokens), vocab_size):  # embedding rows past the tokenizer (llama.cpp pads so)
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # make_model's split regex is Qwen2's
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tcfg["bos_token"]])
    w.add_eos_token_id(vocab[tcfg["eos_token"]])
    w.add_pad_token_id(vocab[tcfg["pad_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tcfg["chat_template"])


def encode(value: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q | None]:
    """(data, raw type for GGUFWriter.add_tensor) of a float32 array; falls back as the docstring says."""
    for q in (qtype, Q.Q8_0, Q.F16):
        block = gguf.GGML_QUANT_SIZES[q][0]
        if value.shape[-1] % block == 0:
            break
    if q == Q.F32:
        return value, None
    if q == Q.F16:
        return value.astype(np.float16), None
    if q == Q.Q4_K:
        return quantize_q4_k(value), Q.Q4_K
    if q == Q.Q5_K:
        return quantize_q5_k(value), Q.Q5_K
    if q == Q.Q6_K:
        return quantize_q6_k(value), Q.Q6_K
        return quantize_q4_k(value.reshape(-1, value.shape[-1])).reshape(*value.shape[:-1], -1), Q.Q4_K
    return gguf.quants.quantize(value, q), q


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 -> Q5_K blocks [rows, cols / 256 * 176]: Q4_K's scheme with 5-bit values
    (the fifth bits of sub-block j in bit j of 32 bytes after the scales)."""
    rows, cols = x.shape
    d, dmin, packed, q = _k_scales(x, 31.0)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= ((q[:, j] >> 4) & 1).astype(np.uint8) << j
    low = q & 0xF
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, qh, qs], axis=1)
    return blocks.reshape(rows, cols // _QK_K * 176)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 -> Q6_K blocks [rows, cols / 256 * 210]: per 16 values an int8 scale of the
    super-block's fp16 d, values q - 32 with q in 0..63 (low nibbles, then 2-bit highs, as ggml packs)."""
    rows, cols = x.shape
    sub = x.reshape(-1, 16, 16)  # [super-blocks, 16-value groups, values]
    want = np.abs(sub).max(-1) / 31.0  # [n, 16]
    d = (want.max(-1, keepdims=True) / 127.0).astype(np.float16)
    safe_d = np.where(d == 0, 1.0, d.astype(np.float32))
    sc = np.clip(np.rint(want / safe_d), -128, 127).astype(np.int8)  # [n, 16]
    eff = d.astype(np.float32) * sc
    safe = np.where(eff == 0, 1.0, eff)[..., None]
    q = (np.clip(np.rint(sub / safe), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    v = q.reshape(-1, 2, 4, 32)  # [n, half, quarter, i]: value 128 h + 32 quarter + i
    ql = np.concatenate([(v[:, h, 0] & 0xF) | ((v[:, h, 2] & 0xF) << 4) for h in (0, 1)] +
                        [(v[:, h, 1] & 0xF) | ((v[:, h, 3] & 0xF) << 4) for h in (0, 1)], axis=1)
    ql = ql.reshape(-1, 4, 32)[:, [0, 2, 1, 3]].reshape(-1, 128)  # per half: bytes 0-31, then 32-63
    qh = np.concatenate([(v[:, h, 0] >> 4) | ((v[:, h, 1] >> 4) << 2) | ((v[:, h, 2] >> 4) << 4) | ((v[:, h, 3] >> 4) << 6)
                         for h in (0, 1)], axis=1)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], axis=1)
    return blocks.reshape(rows, cols // _QK_K * 210)


def _k_scales(x: np.ndarray, levels: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's fp16 d and dmin, 12 packed scale bytes and values [n, 8, 32] (0..levels) of x's
    super-blocks: plain min/max per 32-value sub-block."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale, mins = (sub.max(-1) - lo) / levels, -lo
    d = (scale.max(-1, keepdims=True) / 63.0).astype(np.float16)
    dmin = (mins.max(-1, keepdims=True) / 63.0).astype(np.float16)
    sc, m = _six_bits(scale, d), _six_bits(mins, dmin)
    eff_scale = d.astype(np.float32) * sc
    eff_min = (dmin.astype(np.float32) * m)[..., None]
    safe = np.where(eff_scale == 0, 1.0, eff_scale)[..., None]
    q = np.clip(np.rint((sub + eff_min) / safe), 0, levels).astype(np.uint8)
    packed = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
        m[:, :4] | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4),
    ], axis=1).astype(np.uint8)  # fmt: skip
    return d, dmin, packed, q


def random_blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """Blocks [n, k / block values * block bytes] of a random [n, k] float32 matrix in `qtype` (the
    kernel tests' and benchmarks' weights)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return np.ascontiguousarray(encode(w, qtype)[0])


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 -> Q4_K blocks [rows, cols / 256 * 144] uint8. Per 256-value super-block:
    fp16 d and dmin, 8 six-bit (scale, min) pairs packed into 12 bytes, 256 four-bit values;
    x = d * scale_j * q - dmin * min_j for sub-block j of 32 values."""
    rows, cols = x.shape
    sub = x.reshape(-1, 8, 32)  # [super-blocks, sub-blocks, values]
    lo = np.minimum(sub.min(-1), 0.0)
    scale, mins = (sub.max(-1) - lo) / 15.0, -lo  # [n, 8] each, >= 0
    d = (scale.max(-1, keepdims=True) / 63.0).astype(np.float16)
    dmin = (mins.max(-1, keepdims=True) / 63.0).astype(np.float16)
    sc = _six_bits(scale, d)
    m = _six_bits(mins, dmin)
    eff_scale = d.astype(np.float32) * sc
    eff_min = (dmin.astype(np.float32) * m)[..., None]
    safe = np.where(eff_scale == 0, 1.0, eff_scale)[..., None]
    q = np.clip(np.rint((sub + eff_min) / safe), 0, 15).astype(np.uint8)  # [n, 8, 32]
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2c, 2c+1 share bytes 32c..
    packed = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
        m[:, :4] | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4),
    ], axis=1).astype(np.uint8)  # fmt: skip
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, qs], axis=1)
    return blocks.reshape(rows, cols // _QK_K * 144)


def _six_bits(values: np.ndarray, unit: np.ndarray) -> np.ndarray:
    u = unit.astype(np.float32)
    return np.clip(np.rint(values / np.where(u == 0, 1.0, u)), 0, 63).astype(np.uint8)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.testing.make_gguf", description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", default="F32", choices=sorted(TYPES))
    args = parser.parse_args(argv)
    print(write_gguf(args.folder, args.out, args.type))
    return 0


if __name__ == "__main__":
    sys.exit(main())
