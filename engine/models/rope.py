"""Rotary-embedding parameters from a Hugging Face config (v4 and v5 layouts)."""

from __future__ import annotations

import torch


def rope_parameters(hf_config) -> dict:
    """The config's rope parameters as one dict with at least rope_type and rope_theta."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def rope_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim / 2] and the attention scaling factor, as transformers computes them."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope_type {rope_type!r} is not supported (it changes with sequence length)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}")
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
