"""Rotary-embedding parameters from a Hugging Face config (v4 and v5 layouts)."""

from __future__ import annotations

import torch

from engine.models.layers import RotaryEmbedding

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


def longrope_switch(hf_config, layer_type: str | None = None) -> int | None:
    """Where a LongRoPE config (Phi-3's rope_scaling type longrope) switches from its short factors to
    its long ones: original_max_position_embeddings (transformers: a forward pass whose longest
    position + 1 exceeds it uses the long factors). None for other rope types."""
    params = rope_parameters(hf_config, layer_type)
    if params["rope_type"] != "longrope":
        return None
    original = params.get("original_max_position_embeddings") or getattr(hf_config, "original_max_position_embeddings", None)
    if not original:
        raise ValueError("rope_scaling type 'longrope' needs original_max_position_embeddings")
    return int(original)


def check_rope_supported(hf_config, max_positions: int, layer_type: str | None = None) -> None:
    """ValueError naming the config key when the rope type (of `layer_type`'s layers, rope_parameters())
    is one we cannot serve (checked when the model is built, before any weight is read)."""
    rope_type = rope_parameters(hf_config, layer_type)["rope_type"]
    if rope_type == "dynamic":
        raise ValueError("rope_scaling (rope_parameters) rope_type 'dynamic' is not supported: its "
                         "frequencies change with sequence length")  # fmt: skip
    if rope_type == "longrope" and layer_type is not None:
        raise ValueError("rope_scaling (rope_parameters) rope_type 'longrope' is supported for a model's "
                         "single rope config only, not per layer type")  # fmt: skip


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


def longrope_long_inv_freq(hf_config, switch: int) -> torch.Tensor:
    """The long factors' inv_freq [rotary_dim / 2], as transformers' longrope update computes them
    (its init function at seq_len = switch + 1); the attention factor is the short call's (the same)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, seq_len=switch + 1)[0]


class LongRopeEmbedding(RotaryEmbedding):
    """LongRoPE's cos/sin tables, chosen per sequence as transformers chooses them for one sequence.

    transformers picks the factors per forward pass: the long ones when its largest position + 1 exceeds
    `switch` (original_max_position_embeddings), the short ones otherwise; Phi-3's generate drops its KV
    cache the first time the sequence passes the switch, so the whole sequence is turned again with the
    long ones. For one sequence: at most `switch` tokens, every token on the short factors; more, every
    token on the long ones. The engine keeps that rule per sequence whatever the batch, chunking or
    preemption (the engine core computes a sequence again from its first token when it grows past the
    switch, engine/core/step_loop.py); a batch in transformers would take its longest row's factors for
    every row, and vLLM takes the long ones for the whole step when any position in it passes switch.

    Rows [0, max_positions): position p on the short factors below switch, on the long ones from it (a
    decode at p belongs to a sequence of p + 1 tokens: position alone decides); rows [max_positions,
    max_positions + switch): the long factors below switch, for the tokens below it of a sequence already
    longer than switch (a long prompt, or a recompute: `long_rows`, set by the model runner)."""

    def __init__(self, hf_config, head_dim: int, max_positions: int) -> None:
        super().__init__(lambda: rope_inv_freq(hf_config, head_dim), max_positions)
        switch = longrope_switch(hf_config)
        assert switch is not None
        self.switch: int | None = switch
        self.long_fn = lambda: longrope_long_inv_freq(hf_config, switch)

    def frequencies(self) -> torch.Tensor:
        """Angles [max_positions + switch, rotary_dim / 2] in float32, position times inv_freq as
        transformers multiplies them."""
        assert self.switch is not None
        short, self.scaling = self.inv_freq_fn()
        long = self.long_fn().float()
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        inv = torch.where(pos[:, None] >= self.switch, long[None, :], short.float()[None, :])
        low = torch.arange(self.switch, dtype=torch.float32)
        return torch.cat((pos[:, None] * inv, low[:, None] * long[None, :]))

    def lookup(self, positions: torch.Tensor, long_rows: torch.Tensor | None = None):
        if long_rows is not None:  # a long prompt's tokens below switch: the second table
            positions = positions + long_rows * self.max_positions
        return super().lookup(positions)


def rotary_embedding(hf_config, head_dim: int, max_positions: int) -> RotaryEmbedding:
    """The model's rotary tables: LongRoPE's pair for a longrope config, one table otherwise."""
    if longrope_switch(hf_config) is not None:
        return LongRopeEmbedding(hf_config, head_dim, max_positions)
    return RotaryEmbedding(lambda: rope_inv_freq(hf_config, head_dim), max_positions)
