"""llama.cpp's gemma2 / gemma3 metadata -> transformers' Gemma2Config / Gemma3TextConfig fields.

What llama.cpp's converter writes (conversion/gemma.py) and what its loader (src/models/gemma2.cpp,
gemma3.cpp) assumes when a key is absent, which is what a file means:
- attention.sliding_window: the window; gemma2 4096 when absent; gemma3 absent or 0: no local layers.
- attention.sliding_window_pattern: an int n (layer i is local when i % n < n - 1) or one bool per
  layer (true: local); absent: n = 2 (gemma2), 6 (gemma3).
- rope.freq_base: the global layers' RoPE base; rope.freq_base_swa the local layers' (absent:
  10,000 for gemma3, the global base for gemma2); rope.scaling.* applies to the global layers only.
- the attention scale is not stored: 1/sqrt(hidden / heads) for the 27B models (known by their layer
  count: gemma2 46, gemma3 62), else 1/sqrt(head_dim); that is query_pre_attn_scalar.
- attn_logit_softcapping (gemma2 only; default 50), final_logit_softcapping (gemma2 default 30;
  gemma3 none unless present).
The norm weights hold 1 + weight (engine/weights/gguf/weights.py subtracts the 1 again).
"""

from __future__ import annotations

from typing import Any

from engine.weights.gguf.errors import GGUFError
from engine.weights.gguf.reader import GGUFFile

FULL, SLIDING = "full_attention", "sliding_attention"
DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6}
LAYERS_27B = {"gemma2": 46, "gemma3": 62}  # llama.cpp: LLM_TYPE_27B, whose scale is 1/sqrt(hidden / heads)
_GEMMA3_LOCAL_BASE = 10000.0


def gemma_fields(gf: GGUFFile, fields: dict[str, Any]) -> dict[str, Any]:
    """The Gemma-specific config fields, given the common ones (`fields`: config.config_fields')."""
    arch = gf.architecture
    layers, hidden, heads = fields["num_hidden_layers"], fields["hidden_size"], fields["num_attention_heads"]
    window = _number(gf, "attention.sliding_window", 4096 if arch == "gemma2" else 0)
    layer_types = layer_types_of(gf, layers) if window else [FULL] * layers
    base = float(fields["rope_theta"])
    local_base = float(_number(gf, "rope.freq_base_swa", base if arch == "gemma2" else _GEMMA3_LOCAL_BASE))
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(window) if window else None,
        "layer_types": layer_types,
        "query_pre_attn_scalar": hidden // heads if layers == LAYERS_27B[arch] else fields["head_dim"],
        "final_logit_softcapping": _cap(gf, "final_logit_softcapping", 30.0 if arch == "gemma2" else None),
    }
    scaling = fields.pop("rope_scaling", None)
    fields.pop("rope_parameters", None)
    if arch == "gemma2":
        if local_base != base:
            raise GGUFError(gf.path, f"metadata gemma2.rope.freq_base_swa ({local_base}) differs from rope.freq_base "
                                     f"({base}): transformers' Gemma 2 has one RoPE base")  # fmt: skip
        out["attn_logit_softcapping"] = _cap(gf, "attn_logit_softcapping", 50.0)
        if scaling:
            out["rope_parameters"] = {**scaling, "rope_theta": base}
    else:
        out["attn_logit_softcapping"] = None
        out["rope_parameters"] = {FULL: {"rope_type": "default", **(scaling or {}), "rope_theta": base},
                                  SLIDING: {"rope_type": "default", "rope_theta": local_base}}  # fmt: skip
    return out


def layer_types_of(gf: GGUFFile, layers: int) -> list[str]:
    """transformers' layer_types from attention.sliding_window_pattern (llama.cpp's set_swa_pattern)."""
    key = f"{gf.architecture}.attention.sliding_window_pattern"
    flags = gf.arrays.get(key)
    if flags is not None:
        if len(flags) != layers:
            raise GGUFError(gf.path, f"metadata {key} has {len(flags)} entries for {layers} layers")
        return [SLIDING if bool(f) else FULL for f in flags]
    n = gf.get(key, DEFAULT_PATTERN[gf.architecture])
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise GGUFError(gf.path, f"metadata {key} is {n!r}, expected a layer count or one bool per layer")
    return [SLIDING if n == 0 or i % n < n - 1 else FULL for i in range(layers)]


def pattern_of(layer_types: list[str], arch: str) -> int | list[bool] | None:
    """What make_gguf writes as attention.sliding_window_pattern for `layer_types` (None: llama.cpp's
    default for `arch` says it); the converse of layer_types_of."""
    for n in range(1, len(layer_types) + 1):
        if [SLIDING if i % n < n - 1 else FULL for i in range(len(layer_types))] == list(layer_types):
            return None if n == DEFAULT_PATTERN[arch] else n
    return [t == SLIDING for t in layer_types]


def _number(gf: GGUFFile, suffix: str, default: Any) -> Any:
    value = gf.get(f"{gf.architecture}.{suffix}", default)
    if isinstance(value, bool) or (value is not None and not isinstance(value, (int, float))):
        raise GGUFError(gf.path, f"metadata {gf.architecture}.{suffix} is {value!r}, expected a number")
    return value


def _cap(gf: GGUFFile, suffix: str, default: float | None) -> float | None:
    value = _number(gf, suffix, default)
    return float(value) if value else None  # 0: no cap (llama.cpp's reading)
