"""Rotary-embedding parameters from a Hugging Face config (v4 and v5 layouts)."""

from __future__ import annotations

import torch

LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' layer_types entries


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The config's rope parameters as one dict with at least rope_type and rope_theta. A config with
    parameters per layer type (Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}) gives
    `layer_type`'s, the full-attention layers' when None."""
    params = getattr(hf_config, "rope_parameters", None)
    if params and set(params) <= set(LAYER_TYPES):
        params = params.get(layer_type or "full_attention")
    if params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def rotary_dim_of(hf_config, head_dim: int) -> int:
    """How many leading dims of each head RoPE turns: head_dim times partial_rotary_factor (Phi-4-mini:
    0.75), as transformers rounds it. The factor sits in rope_parameters (transformers 5) or on the config."""
    factor = rope_parameters(hf_config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    dim = int(head_dim * float(factor))
    if dim <= 0 or dim > head_dim or dim % 2:
        raise ValueError(f"partial_rotary_factor {factor} gives {dim} rotary dims of {head_dim}: not supported")
    return dim


def short_rope_limit(hf_config, layer_type: str | None = None) -> int | None:
    """The longest context a LongRoPE config (Phi-3's rope_scaling type longrope) is served at: its
    original_max_position_embeddings, where transformers uses the short factors for the whole
    sequence (the long ones, switched on past it, are not implemented). None for other rope types."""
    params = rope_parameters(hf_config, layer_type)
    if params["rope_type"] != "longrope":
        return None
    original = params.get("original_max_position_embeddings") or getattr(hf_config, "original_max_position_embeddings", None)
    if not original:
        raise ValueError("rope_scaling type 'longrope' needs original_max_position_embeddings")
    return int(original)


def check_rope_supported(hf_config, max_positions: int, layer_type: str | None = None) -> None:
    """ValueError naming the config key when the rope type (of `layer_type`'s layers, rope_parameters())
    is one we cannot serve at `max_positions` (checked when the model is built, before any weight is read)."""
    rope_type = rope_parameters(hf_config, layer_type)["rope_type"]
    if rope_type == "dynamic":
        raise ValueError("rope_scaling (rope_parameters) rope_type 'dynamic' is not supported: its "
                         "frequencies change with sequence length")  # fmt: skip
    limit = short_rope_limit(hf_config, layer_type)
    if limit is not None and max_positions > limit:
        raise ValueError(f"rope_scaling (rope_parameters) rope_type 'longrope' is not supported past "
                         f"original_max_position_embeddings ({limit} tokens; max_model_len asks for "
                         f"{max_positions}): its long factors are not implemented")  # fmt: skip


def rope_inv_freq(hf_config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """inv_freq [rotary_dim / 2] and the attention scaling factor, as transformers computes them
    (`layer_type`: that layer type's parameters, rope_parameters())."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = float(params["rope_theta"])
        dim = rotary_dim_of(hf_config, head_dim)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}")
    # longrope without seq_len: the short factors, and its attention factor on cos/sin
    if set(getattr(hf_config, "rope_parameters", None) or {"-"}) <= set(LAYER_TYPES):  # per layer type
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, layer_type=layer_type or "full_attention")
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
