"""Build small, seeded Hugging Face model folders for tests and benchmarks, without any download.

Each folder holds what `transformers.AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` need:
config.json, model.safetensors (random weights), generation_config.json, and a byte-level BPE
tokenizer (tokenizer.json, tokenizer_config.json with a ChatML chat template, special_tokens_map.json)
trained on this Python's own standard library.

    python -m engine.testing.make_model tiny-llama /tmp/tiny-llama [--force]

The same preset built twice on one machine gives byte-identical weights. Building is safe when several
processes race: each builds into a private temporary folder and renames it into place, so a model
folder is either absent or complete. Not thread-safe: seeding uses torch's process-wide generator.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Special tokens get the first ids, in this order: 0, 1, 2.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# ChatML convention (Qwen2.5-Instruct, SmolLM2-Instruct): a reply ends with <|im_end|>, so that is EOS;
# <|endoftext|> serves as BOS (never added automatically) and padding.
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = ENDOFTEXT, IM_END, ENDOFTEXT

TINY_VOCAB = 2048  # small so tiny models train their tokenizer in about a second
BENCH_VOCAB = 49152  # SmolLM2's vocabulary size

# Accepts OpenAI-style content given as a string, as a list of {"type": "text", "text": ...} parts,
# or as null (an assistant turn that only calls tools).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Repeated in the training text so that some CJK characters become single tokens while others (and
# emoji) stay split over byte tokens: both cases matter to incremental detokenization.
_MULTILINGUAL_TEXT = (
    "你好，世界！今天天气很好，我们去公园散步吧。机器学习和自然语言处理很有意思。\n"
    "こんにちは、世界。東京は日本の首都です。ひらがなとカタカナと漢字。\n"
    "안녕하세요, 세계. Grüße aus Köln, ça va? Ñandú, café, naïve, Ελληνικά, русский язык.\n"
    "Emoji: 😀 😂 🚀 ✨ 🎉 👍🏽 👨‍👩‍👧 🇯🇵 ❤️ 🤖 — “quotes” ‘single’ … ½ € ™\n"
)
_MULTILINGUAL_REPEATS = 50
# Tests are most of the standard library's bytes and slow training down without adding variety.
_SKIPPED_STDLIB_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages"})

# Qwen2's split regex (GPT-4 style; digits one by one). transformers 5 loads every qwen2 model's tokenizer
# as Qwen2Tokenizer, which rebuilds the pipeline as NFC + this split + ByteLevel no matter what
# tokenizer.json says; using that pipeline for every preset keeps all loaders on the same token ids.
_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

_MARKER_FILE = "tokenmill_make_model.json"  # written last; says which preset (and version) built the folder
_FORMAT_VERSION = 2  # bump when the layout, weight or tokenizer recipe changes, so caches rebuild
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    _MARKER_FILE,
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Preset:
    """Shape and recipe of one generated model. Weights depend only on these fields."""

    architecture: str  # transformers model class, e.g. "LlamaForCausalLM"
    tokenizer_vocab_size: int  # size of the trained BPE tokenizer, special tokens included
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # fewer than num_attention_heads: grouped-query attention
    head_dim: int  # need not equal hidden_size / num_attention_heads (Qwen3 style)
    tie_word_embeddings: bool
    seed: int
    dtype: str = "float32"  # dtype of the saved weights
    vocab_size: int | None = None  # config/embedding rows; None: tokenizer_vocab_size
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02  # std of the random init
    extra_config: tuple[tuple[str, object], ...] = ()  # other config kwargs, e.g. sliding_window

    def __post_init__(self) -> None:
        if not hasattr(transformers, self.architecture):
            raise ValueError(f"architecture {self.architecture!r} is not a transformers class")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.config_vocab_size < self.tokenizer_vocab_size:
            raise ValueError("vocab_size must be at least tokenizer_vocab_size")

    @property
    def config_vocab_size(self) -> int:
        return self.tokenizer_vocab_size if self.vocab_size is None else self.vocab_size

    def fingerprint(self) -> str:
        """Hash of the recipe; a cached folder with another fingerprint is rebuilt."""
        recipe = json.dumps([_FORMAT_VERSION, dataclasses.asdict(self)], sort_keys=True)
        return hashlib.sha256(recipe.encode()).hexdigest()[:16]


_TINY = {
    "tokenizer_vocab_size": TINY_VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "initializer_range": 0.12,  # smaller values make greedy decoding repeat one token
}

PRESETS: dict[str, Preset] = {
    # Shapes differ on purpose: GQA groups of 2 and 4 (MQA), a head_dim that is not hidden/heads,
    # an odd layer count, tied and untied embeddings, so a shape bug shows up in some preset.
    "tiny-llama": Preset(
        "LlamaForCausalLM",
        **_TINY,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        seed=1,
    ),
    # tiny-llama's shape and tokenizer with other weights: a second version of "the same model" whose
    # greedy outputs differ (model-version swap tests and benchmarks).
    "tiny-llama-b": Preset(
        "LlamaForCausalLM",
        **_TINY,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        seed=11,
    ),
    "tiny-qwen2": Preset(
        "Qwen2ForCausalLM",
        **_TINY,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        seed=2,
    ),
    # Tied embeddings pull greedy decoding toward repeating the last token; a larger init offsets that.
    "tiny-qwen3": Preset(
        "Qwen3ForCausalLM",
        **{**_TINY, "initializer_range": 0.2},
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        seed=3,
    ),
    "tiny-mistral": Preset(
        "MistralForCausalLM",
        **_TINY,
        num_hidden_layers=3,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=False,
        seed=4,
        extra_config=(("sliding_window", None),),
    ),
    # Sliding windows (engine/models/windows.py) shorter than the test prompts, so the window matters:
    # Mistral's on every layer (the engine frees blocks that left it), Qwen2's on the layers from
    # max_window_layers on (a model mixing full and sliding layers keeps every block).
    "tiny-mistral-swa": Preset(
        "MistralForCausalLM",
        **_TINY,
        num_hidden_layers=3,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=False,
        seed=31,
        extra_config=(("sliding_window", 12),),
    ),
    "tiny-qwen2-swa": Preset(
        "Qwen2ForCausalLM",
        **_TINY,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        seed=32,
        extra_config=(("use_sliding_window", True), ("sliding_window", 16), ("max_window_layers", 1)),
    ),
    # The other Llama-like families (engine/models/): each the tiny shape with what makes it differ.
    # OLMo 2: norms after attention and MLP, Q/K norms over the whole projection.
    "tiny-olmo2": Preset(
        "Olmo2ForCausalLM",
        **_TINY,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        seed=21,
    ),
    # Granite 3: every multiplier away from 1 (the attention one away from 1/sqrt(head_dim)) so each shows.
    "tiny-granite": Preset(
        "GraniteForCausalLM",
        **_TINY,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        seed=22,
        extra_config=(("embedding_multiplier", 6.0), ("residual_multiplier", 0.5),
                      ("attention_multiplier", 0.1), ("logits_scaling", 4.0)),  # fmt: skip
    ),
    # SmolLM3: every 4th layer without RoPE (no_rope_layers: 1 = rotary, 0 = NoPE), the real model's
    # pattern and the only one llama.cpp's smollm3 files can say.
    "tiny-smollm3": Preset(
        "SmolLM3ForCausalLM",
        **_TINY,
        num_hidden_layers=4,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=False,
        seed=23,
        extra_config=(("no_rope_layers", (1, 1, 1, 0)),),
    ),
    # Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj in the checkpoint, RoPE on 3/4 of each head.
    "tiny-phi3": Preset(
        "Phi3ForCausalLM",
        **_TINY,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        seed=24,
        extra_config=(("partial_rotary_factor", 0.75),),
    ),
    # Phi-3 with LongRoPE (Phi-3-mini-128k, Phi-4-mini): short factors below a 32-token original context,
    # long ones past it (most test prompts cross it; transformers switches per forward pass), the
    # attention factor from 512 / 32. Factors far from 1 and from each other, so a wrong choice shows.
    "tiny-phi3-longrope": Preset(
        "Phi3ForCausalLM",
        **_TINY,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        seed=27,
        max_position_embeddings=512,
        extra_config=(("partial_rotary_factor", 0.75), ("original_max_position_embeddings", 32),
                      ("rope_scaling", {"rope_type": "longrope", "partial_rotary_factor": 0.75,
                                        "short_factor": [1.0 + 0.05 * i for i in range(12)],
                                        "long_factor": [1.0 + 1.5 * i for i in range(12)],
                                        "original_max_position_embeddings": 32})),  # fmt: skip
    ),
    # Gemma 2: scaled embeddings, (1 + weight) norms before and after attention and MLP, GeGLU, both
    # soft-caps, query_pre_attn_scalar = head_dim (what llama.cpp's gemma2 assumes) != hidden / heads,
    # sliding and global layers alternating (a 24-token window: most test prompts are longer), tied embeddings.
    "tiny-gemma2": Preset(
        "Gemma2ForCausalLM",
        **_TINY,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        seed=25,
        extra_config=(("query_pre_attn_scalar", 64), ("sliding_window", 24), ("attn_logit_softcapping", 50.0),
                      ("final_logit_softcapping", 30.0)),  # fmt: skip
    ),
    # Gemma 3: Gemma 2 with Q/K norms, no attention soft-cap; three local layers (RoPE base 10,000, a 20-token
    # window) then a global one (base 1e6, linear rope scaling as Gemma 3 4B and up have).
    "tiny-gemma3": Preset(
        "Gemma3ForCausalLM",
        **_TINY,
        num_hidden_layers=4,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
        seed=26,
        rope_theta=1000000.0,
        extra_config=(("query_pre_attn_scalar", 32), ("sliding_window", 20), ("rope_local_base_freq", 10000.0),
                      ("rope_scaling", {"rope_type": "linear", "factor": 8.0}),
                      ("layer_types", ("sliding_attention",) * 3 + ("full_attention",))),  # fmt: skip
    ),
    # Mixture of experts (engine/models/moe.py): 8 experts, top-2, experts narrower than the dense MLP.
    # Qwen3-MoE: a dense layer among the sparse ones (mlp_only_layers), the top-2 weights renormalised.
    "tiny-qwen3-moe": Preset(
        "Qwen3MoeForCausalLM",
        **_TINY,
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        seed=41,
        extra_config=(("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 64),
                      ("norm_topk_prob", True), ("decoder_sparse_step", 1), ("mlp_only_layers", (1,))),  # fmt: skip
    ),
    # Qwen2-MoE: q/k/v biases, a shared expert with its sigmoid gate, top-2 weights as the softmax gave them.
    "tiny-qwen2-moe": Preset(
        "Qwen2MoeForCausalLM",
        **_TINY,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        seed=42,
        extra_config=(("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 64),
                      ("shared_expert_intermediate_size", 96), ("norm_topk_prob", False)),  # fmt: skip
    ),
    # OLMoE: Q/K norms over the whole projection (head_dim must be hidden / heads), every layer sparse.
    "tiny-olmoe": Preset(
        "OlmoeForCausalLM",
        **{**_TINY, "intermediate_size": 64},
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        seed=43,
        extra_config=(("num_experts", 8), ("num_experts_per_tok", 2), ("norm_topk_prob", False)),
    ),
    # Mixtral: block_sparse_moe with w1/w2/w3 experts in the checkpoint, the top-2 renormalised.
    "tiny-mixtral": Preset(
        "MixtralForCausalLM",
        **{**_TINY, "intermediate_size": 64},
        num_hidden_layers=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=False,
        seed=44,
        extra_config=(("num_local_experts", 8), ("num_experts_per_tok", 2), ("sliding_window", None)),
    ),
    # GPT-OSS: attention sinks, q/k/v/o biases, sliding (a 24-token window: most test prompts are longer)
    # and full layers alternating, YaRN rope (factor 4 over 128 original positions), 8 experts top-2 with
    # router and expert biases and the clamped SwiGLU.
    "tiny-gpt-oss": Preset(
        "GptOssForCausalLM",
        **{**_TINY, "intermediate_size": 64},
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        seed=45,
        rope_theta=150000.0,
        max_position_embeddings=512,
        extra_config=(("num_local_experts", 8), ("num_experts_per_tok", 2), ("sliding_window", 24),
                      ("layer_types", ("sliding_attention", "full_attention")),
                      ("rope_parameters", {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 128})),  # fmt: skip
    ),
    # LFM2 (engine/models/lfm2.py): gated short convolutions (3 taps, the real models' L_cache) mixed with
    # GQA attention layers with Q/K norms, LFM2-350M's pattern shrunk (conv first, attention at 2 and 4),
    # tied embeddings; the MLP width by LFM2's rule (2/3 of 300 rounded up to 64: 256), so a wrong rule
    # fails to load.
    "tiny-lfm2": Preset(
        "Lfm2ForCausalLM",
        **{**_TINY, "intermediate_size": 300, "initializer_range": 0.2},
        num_hidden_layers=6,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        seed=51,
        extra_config=(("layer_types", ("conv", "conv", "full_attention", "conv", "full_attention", "conv")),
                      ("conv_L_cache", 3), ("block_multiple_of", 64), ("block_ffn_dim_multiplier", 1.0),
                      ("block_auto_adjust_ff_dim", True), ("norm_eps", 1e-5)),  # fmt: skip
    ),
    # LFM2-350M's layer pattern (16 layers: 10 short convs, attention at 2, 5, 8, 10, 12, 14) at half its
    # width (hidden 512, MLP 1536 by LFM2's rule, 8 query / 4 KV heads of 64): 56 M parameters, the
    # multi-turn benchmark's model (python -m bench multiturn), a 2,000-token prefill in seconds on a CPU.
    "bench-lfm2": Preset(
        "Lfm2ForCausalLM",
        tokenizer_vocab_size=TINY_VOCAB,
        hidden_size=512,
        intermediate_size=2304,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=True,
        seed=350,
        max_position_embeddings=4096,
        initializer_range=0.05,
        extra_config=(("layer_types", tuple("full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv"
                                            for i in range(16))),
                      ("conv_L_cache", 3), ("block_multiple_of", 256), ("block_ffn_dim_multiplier", 1.0),
                      ("block_auto_adjust_ff_dim", True), ("norm_eps", 1e-5)),  # fmt: skip
    ),
    # Qwen3.5 text model (engine/models/qwen35.py): Gated DeltaNet layers (a 4-tap conv over q/k/v, the
    # delta rule with a [heads, k_dim, v_dim] state) and gated attention layers with Q/K norms and RoPE on
    # a quarter of each head (transformers' default partial_rotary_factor), (1 + w) norms. Two attention
    # layers after every two DeltaNet ones (full_attention_interval 3: transformers fills layer_types);
    # 4 value heads on 2 key heads and k_dim != v_dim, so a broadcast or transpose bug shows.
    "tiny-qwen35": Preset(
        "Qwen3_5ForCausalLM",
        **{**_TINY, "initializer_range": 0.2},
        num_hidden_layers=6,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        seed=61,
        extra_config=(("full_attention_interval", 3), ("linear_conv_kernel_dim", 4), ("linear_key_head_dim", 16),
                      ("linear_value_head_dim", 24), ("linear_num_key_heads", 2),
                      ("linear_num_value_heads", 4)),  # fmt: skip
    ),
    # Qwen3.5's MoE variant: tiny-qwen35's layers with 8 experts (top 2, renormalised) and a shared expert
    # on every layer.
    "tiny-qwen35-moe": Preset(
        "Qwen3_5MoeForCausalLM",
        **{**_TINY, "initializer_range": 0.2},
        num_hidden_layers=6,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        seed=62,
        extra_config=(("full_attention_interval", 3), ("linear_conv_kernel_dim", 4), ("linear_key_head_dim", 16),
                      ("linear_value_head_dim", 24), ("linear_num_key_heads", 2), ("linear_num_value_heads", 4),
                      ("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 64),
                      ("shared_expert_intermediate_size", 96)),  # fmt: skip
    ),
    # Granite 4 (engine/models/granite_hybrid.py): Mamba2 layers (8 heads of 32 in 2 groups, d_state 16, a
    # 4-tap conv, scan blocks of 32 tokens, so prompts span several) mixed with NoPE GQA attention layers, the
    # hub's "mamba" / "attention" names; every Granite multiplier away from 1; Granite 4.0-H-tiny's MLP: a
    # shared SwiGLU plus 4 experts, top 2.
    "tiny-granite4": Preset(
        "GraniteMoeHybridForCausalLM",
        **{**_TINY, "intermediate_size": 64},
        num_hidden_layers=6,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        seed=61,
        extra_config=(("layer_types", ("mamba", "mamba", "attention", "mamba", "attention", "mamba")),
                      ("mamba_n_heads", 8), ("mamba_n_groups", 2), ("mamba_d_state", 16), ("mamba_d_conv", 4),
                      ("mamba_expand", 2), ("mamba_chunk_size", 32), ("position_embedding_type", "nope"),
                      ("num_local_experts", 4), ("num_experts_per_tok", 2), ("shared_intermediate_size", 128),
                      ("embedding_multiplier", 6.0), ("residual_multiplier", 0.5), ("attention_multiplier", 0.1),
                      ("logits_scaling", 4.0)),  # fmt: skip
    ),
    # Granite 4 dense (num_local_experts 0: the shared MLP alone) with RoPE on its attention layers, one
    # group of 4 Mamba2 heads of 64 and scan blocks of 16 tokens; init std 0.2 (at 0.12 greedy repeats).
    "tiny-granite4-dense": Preset(
        "GraniteMoeHybridForCausalLM",
        **{**_TINY, "initializer_range": 0.2},
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        seed=62,
        extra_config=(("layer_types", ("attention", "mamba", "mamba", "attention")),
                      ("mamba_n_heads", 4), ("mamba_n_groups", 1), ("mamba_d_state", 16), ("mamba_d_conv", 4),
                      ("mamba_expand", 2), ("mamba_chunk_size", 16), ("position_embedding_type", "rope"),
                      ("num_local_experts", 0), ("shared_intermediate_size", 256),
                      ("embedding_multiplier", 6.0), ("residual_multiplier", 0.5), ("attention_multiplier", 0.1),
                      ("logits_scaling", 4.0)),  # fmt: skip
    ),
    # Every matrix row a multiple of 256 values, so K-quant GGUF files (engine/testing/make_gguf.py)
    # quantize all of them; tied, so the file has no output.weight.
    "tiny-llama-k": Preset(
        "LlamaForCausalLM",
        **{**_TINY, "hidden_size": 256, "intermediate_size": 512, "initializer_range": 0.08},
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        seed=6,
    ),
    # tiny-llama with SmolLM2's vocabulary width (49,152 embedding and output rows; the tokenizer's 2,048
    # tokens, as a checkpoint whose embedding has rows no token names): per-step work over the whole
    # vocabulary (sampling, a full-vocabulary logit_bias) at a realistic size, with tiny compute.
    "tiny-llama-wide": Preset(
        "LlamaForCausalLM",
        **_TINY,
        vocab_size=BENCH_VOCAB,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        seed=12,
    ),
    # OLMoE-1B-7B's routing (64 experts, top-8, no renormalisation) at half its width and depth (hidden
    # 1024, expert width 512, 8 layers): 0.88 B parameters, 0.18 B active a token; the MoE benchmark's
    # model (python -m bench moe), small enough to build and serve on a 24 GiB machine.
    "bench-olmoe": Preset(
        "OlmoeForCausalLM",
        tokenizer_vocab_size=BENCH_VOCAB,
        hidden_size=1024,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=64,
        tie_word_embeddings=False,
        seed=77,
        dtype="bfloat16",
        max_position_embeddings=4096,
        initializer_range=0.02,
        extra_config=(("num_experts", 64), ("num_experts_per_tok", 8), ("norm_topk_prob", False)),
    ),
    # SmolLM2-135M's shape and init std: a realistic CPU benchmark model.
    "bench-135m": Preset(
        "LlamaForCausalLM",
        tokenizer_vocab_size=BENCH_VOCAB,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
        seed=135,
        dtype="bfloat16",
        rope_theta=100000.0,
        max_position_embeddings=8192,
        initializer_range=0.041666666666666664,
    ),
    # Qwen2.5-0.5B's shape for GPU checks (~1 GB); the embedding has more rows than the tokenizer, as in
    # the real checkpoint.
    "qwen25-05b-shape": Preset(
        "Qwen2ForCausalLM",
        tokenizer_vocab_size=BENCH_VOCAB,
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        seed=505,
        dtype="bfloat16",
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        initializer_range=0.02,
    ),
}


def get_preset(name: str) -> Preset:
    """The preset called `name`; ValueError naming the known presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def default_cache_dir() -> Path:
    """$TOKENMILL_MODEL_CACHE, else <repo>/models/ (git-ignored)."""
    return Path(os.environ.get("TOKENMILL_MODEL_CACHE") or _REPO_ROOT / "models")


def ensure_model(preset: str, cache_dir: str | Path | None = None) -> Path:
    """Path of `cache_dir/preset`, building it first if it is missing, stale or incomplete."""
    get_preset(preset)  # fail on a bad name before touching the disk
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_model(preset, root / preset)


def build_model(preset: str, out_dir: str | Path, force: bool = False) -> Path:
    """Build `preset` into `out_dir` and return it; a complete folder of this preset is kept unless `force`.

    Raises ValueError for an unknown preset and FileExistsError when `out_dir` holds files that
    make_model did not write (it never deletes those).
    """
    spec = get_preset(preset)
    out = Path(out_dir)
    if not force and is_complete(out, preset):
        return out
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target so the final rename stays on one filesystem and is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_model_folder(spec, preset, tmp)
        _install(tmp, out, preset, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_complete(folder: str | Path, preset: str) -> bool:
    """True when `folder` holds every file of a finished build of the current `preset` recipe."""
    folder = Path(folder)
    if not all((folder / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        marker = json.loads((folder / _MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker == _marker(preset)


def _marker(preset: str) -> dict[str, object]:
    return {"preset": preset, "fingerprint": get_preset(preset).fingerprint()}


def _check_replaceable(out: Path) -> None:
    """Refuse to replace a folder that make_model did not build: it may be someone's data."""
    if out.is_dir() and any(out.iterdir()) and not (out / _MARKER_FILE).is_file():
        raise FileExistsError(f"{out} exists and was not built by make_model; remove it or pick another path")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder")


def _install(tmp: Path, out: Path, preset: str, force: bool) -> None:
    """Rename the finished `tmp` to `out`. If another process got there first, keep its build."""
    for _ in range(3):  # each retry follows a racing writer; three is plenty in practice
        try:
            os.rename(tmp, out)  # atomic; fails if `out` is a non-empty folder
            return
        except OSError:
            if not force and is_complete(out, preset):
                return
            _move_aside(out)
    raise RuntimeError(f"could not install {out}: other processes keep replacing it")


def _move_aside(out: Path) -> None:
    """Remove an old build with a rename first, so readers never see it half-deleted."""
    _check_replaceable(out)
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    try:
        os.rename(out, trash / "old")
    except FileNotFoundError:
        pass  # a racing process moved it already
    shutil.rmtree(trash, ignore_errors=True)


def _write_model_folder(spec: Preset, preset: str, folder: Path) -> None:
    """Write every file of the model into the empty `folder`; the marker goes last."""
    special_ids = _write_tokenizer(folder, spec)
    config = _make_config(spec, special_ids)
    model = _init_model(spec, config)
    model.save_pretrained(folder, safe_serialization=True)
    _write_json(folder / "generation_config.json", _generation_config(special_ids))
    _patch_config_json(folder / "config.json", spec)
    _write_json(folder / _MARKER_FILE, _marker(preset))
    # mkdtemp makes the folder private and transformers writes the weights 0600; a shared cache is
    # read by other users (a container's server, CI), so open both up.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _make_config(spec: Preset, special_ids: dict[str, int]) -> transformers.PretrainedConfig:
    config_class = getattr(transformers, spec.architecture).config_class
    # rope_theta as a keyword works in transformers 4 and 5 (5 moves it into rope_parameters)
    return config_class(
        vocab_size=spec.config_vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=special_ids[BOS_TOKEN],
        eos_token_id=special_ids[EOS_TOKEN],
        pad_token_id=special_ids[PAD_TOKEN],
        **{key: list(value) if isinstance(value, tuple) else value for key, value in spec.extra_config},
    )


def _init_model(spec: Preset, config: transformers.PretrainedConfig) -> torch.nn.Module:
    """Random weights from the seed alone; the caller's torch RNG state is left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        # float32 first so the random draws do not depend on the target dtype
        model = getattr(transformers, spec.architecture)(config).to(torch.float32)
        _randomize_norms_and_biases(model, spec.initializer_range)
    model.to(_DTYPES[spec.dtype])
    model.config.dtype = spec.dtype
    return model.eval()


@torch.no_grad()
def _randomize_norms_and_biases(model: torch.nn.Module, std: float) -> None:
    # Fresh RMSNorm weights are exactly 1 and biases 0, so an engine that skips a norm (Qwen3's q/k norm)
    # or a bias (Qwen2's q/k/v bias) would still match. Random values make such bugs visible.
    # Gemma's norms scale by 1 + weight: around 1 (weight in [-0.5, 0.5]), but 5 to 6 on the attention
    # and MLP outputs: with those near 1 the sqrt(hidden)-scaled embedding dominates the residual stream
    # and the tied logits repeat the last token forever.
    gemma = type(model).__name__.startswith("Gemma")
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            low = (4.0 if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"))
                   else -0.5) if gemma else 0.5  # fmt: skip
            param.uniform_(low, low + 1.0)
        elif name.endswith(".sinks"):  # GPT-OSS: around exp(1) times a key's weight, so they matter
            param.normal_(1.0, 1.0)
        elif name.endswith((".bias", "_bias")):  # GPT-OSS's experts: gate_up_proj_bias, down_proj_bias
            param.normal_(0.0, 4 * std)


def _generation_config(special_ids: dict[str, int]) -> dict[str, object]:
    # Greedy by default: no temperature/top_p, so the engine's own defaults apply.
    return {
        "bos_token_id": special_ids[BOS_TOKEN],
        "eos_token_id": special_ids[EOS_TOKEN],
        "pad_token_id": special_ids[PAD_TOKEN],
        "do_sample": False,
        "transformers_version": transformers.__version__,
    }


def _patch_config_json(path: Path, spec: Preset) -> None:
    # transformers 5 writes rope_parameters and dtype; older loaders read rope_theta and torch_dtype.
    config = json.loads(path.read_text())
    config["rope_theta"] = spec.rope_theta
    config["torch_dtype"] = spec.dtype
    config["dtype"] = spec.dtype
    _write_json(path, config)


def _write_tokenizer(folder: Path, spec: Preset) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return special token ids."""
    tokenizer_json = trained_tokenizer_json(spec.tokenizer_vocab_size)
    (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    tokenizer = Tokenizer.from_str(tokenizer_json)
    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    _write_json(
        folder / "tokenizer_config.json", _tokenizer_config(special_ids, spec.max_position_embeddings)
    )
    _write_json(
        folder / "special_tokens_map.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )
    return special_ids


def _tokenizer_config(special_ids: dict[str, int], model_max_length: int) -> dict[str, object]:
    # "PreTrainedTokenizerFast" loads in transformers 4 and 5 (5 would write "TokenizersBackend").
    added = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token, token_id in special_ids.items()
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,  # byte-level BPE encodes every byte: nothing is unknown
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # cleanup would break decode(encode(s)) == s
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


@functools.cache
def trained_tokenizer_json(vocab_size: int) -> str:
    """tokenizer.json text of a byte-level BPE with `vocab_size` tokens, trained once per process.

    Deterministic for a given Python installation; cached as an immutable string so presets that
    share a vocabulary size share one training run.
    """
    tokenizer = Tokenizer(models.BPE())
    # Byte-level: every byte has a token, so any NFC text (all CJK and emoji included) round-trips
    # exactly; NFC because Qwen2Tokenizer forces it (see _SPLIT_REGEX).
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # ~1,000 characters per token is ample for BPE's pair counts; less text keeps small vocabularies fast
    tokenizer.train_from_iterator(_training_texts(max_chars=1000 * vocab_size), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"training text only yields {tokenizer.get_vocab_size()} tokens, not {vocab_size}")
    return tokenizer.to_str()


def _training_texts(max_chars: int) -> Iterator[str]:
    # This Python's standard library: on every machine, no download, fixed for a given installation.
    yield _MULTILINGUAL_TEXT * _MULTILINGUAL_REPEATS
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if total >= max_chars:
            return
        if not _SKIPPED_STDLIB_DIRS.intersection(path.relative_to(root).parts):
            text = path.read_text(encoding="utf-8", errors="replace")
            total += len(text)
            yield text


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.testing.make_model", description=__doc__.split("\n")[0]
    )
    parser.add_argument("preset", choices=list(PRESETS))
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    args = parser.parse_args(argv)
    print(build_model(args.preset, args.output_dir, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
