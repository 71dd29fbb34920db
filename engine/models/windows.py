"""Which layers attend through a sliding window, read from a Hugging Face config the way transformers
reads it for that config class. One place, used by the models (each attention layer's `window` and KV-cache
group), the start-up log and the KV-cache groups (engine/kv/groups.py: a group's blocks that left its
window are freed)."""

from __future__ import annotations

# Config classes whose transformers model applies `sliding_window` to every layer and ignores any
# `layer_types` (MistralConfig warns about it and keeps the window on all layers).
UNIFORM_WINDOW_TYPES = frozenset({"mistral", "phi3"})


def layer_windows(cfg) -> list[int | None]:
    """Per layer, its sliding window W (the query at position p sees keys p - W < k <= p) or None
    for full attention.

    - `layer_types` (Gemma 2/3, Qwen2/Qwen3 and SmolLM3 configs fill it in): "sliding_attention"
      layers get `sliding_window`, the others none.
    - without it: `sliding_window` set and `use_sliding_window` not false -> every layer, except a
      config with `max_window_layers` (Qwen2's rule): the layers from that index on.
    """
    n = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return [None] * n
    window = int(window)
    types = getattr(cfg, "layer_types", None)
    if types is not None and getattr(cfg, "model_type", None) not in UNIFORM_WINDOW_TYPES:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        return [window if t == "sliding_attention" else None for t in types]
    first = getattr(cfg, "max_window_layers", None)
    if first is not None:
        return [window if i >= int(first) else None for i in range(n)]
    return [window] * n


def uniform_window(cfg) -> int | None:
    """The window when every layer is a sliding layer with the same one (Mistral): the model's one KV-cache
    group has it (group_windows). None otherwise."""
    windows = layer_windows(cfg)
    return windows[0] if windows and windows[0] is not None and len(set(windows)) == 1 else None


def group_windows(cfg) -> list[int | None]:
    """The KV-cache groups of a model (engine/kv/groups.py): one per distinct layer window, full
    attention (None) first, then the windows in increasing order. One group for a model whose layers
    all have the same window (Llama: [None]; Mistral: [W]); Gemma 2/3: [None, W]."""
    distinct = set(layer_windows(cfg))
    return ([None] if None in distinct else []) + sorted(w for w in distinct if w is not None)


def layer_groups(cfg) -> list[int]:
    """Per layer, the index of its KV-cache group in group_windows(cfg)."""
    groups = group_windows(cfg)
    return [groups.index(w) for w in layer_windows(cfg)]
