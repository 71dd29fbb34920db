"""gemma2 / gemma3 metadata read as llama.cpp reads it (engine/weights/gguf/gemma.py): the layer pattern
(int or per-layer bools, the architecture's default), the local RoPE base, the soft-caps' defaults,
and the attention scale llama.cpp derives (head_dim, or hidden / heads for the 27B layer counts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.weights.gguf.errors import GGUFError
from engine.weights.gguf.gemma import FULL, SLIDING, gemma_fields, layer_types_of, pattern_of
from engine.weights.gguf.reader import GGUFFile


def _file(arch: str, metadata: dict | None = None, arrays: dict | None = None) -> GGUFFile:
    return GGUFFile(Path(f"{arch}.gguf"), 0, arch, {f"{arch}.{k}": v for k, v in (metadata or {}).items()}, {},
                    (), None, {f"{arch}.{k}": v for k, v in (arrays or {}).items()})  # type: ignore[arg-type]


def _common(layers: int, hidden: int = 640, heads: int = 4, head_dim: int = 256) -> dict:
    return {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "head_dim": head_dim,
            "rope_theta": 1e6}


def test_gemma3_270m_metadata_gives_its_config():
    """What the real 270M file says (window 512, no pattern or local-base key): five local layers then
    a global one, local base 10,000, scale from head_dim 256, no soft-caps."""
    out = gemma_fields(_file("gemma3", {"attention.sliding_window": 512}), _common(18))
    assert out["layer_types"] == ([SLIDING] * 5 + [FULL]) * 3
    assert out["sliding_window"] == 512 and out["query_pre_attn_scalar"] == 256
    assert out["rope_parameters"] == {FULL: {"rope_type": "default", "rope_theta": 1e6},
                                      SLIDING: {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip
    assert out["final_logit_softcapping"] is None and out["attn_logit_softcapping"] is None


def test_gemma3_27b_scale_linear_scaling_and_local_base_key():
    fields = {**_common(62, hidden=5376, heads=32, head_dim=128), "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    out = gemma_fields(_file("gemma3", {"attention.sliding_window": 1024, "rope.freq_base_swa": 20000.0,
                                        "final_logit_softcapping": 30.0}), fields)  # fmt: skip
    assert out["query_pre_attn_scalar"] == 5376 // 32  # 168, llama.cpp's 27B rule
    assert out["rope_parameters"][FULL] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert out["rope_parameters"][SLIDING] == {"rope_type": "default", "rope_theta": 20000.0}
    assert out["final_logit_softcapping"] == 30.0


def test_gemma3_without_a_window_has_only_global_layers():
    out = gemma_fields(_file("gemma3"), _common(4))
    assert out["layer_types"] == [FULL] * 4 and out["sliding_window"] is None


def test_gemma2_defaults_and_its_single_rope_base():
    out = gemma_fields(_file("gemma2"), {**_common(26, hidden=2304, heads=8), "rope_theta": 10000.0})
    assert out["layer_types"] == [SLIDING, FULL] * 13 and out["sliding_window"] == 4096
    assert out["attn_logit_softcapping"] == 50.0 and out["final_logit_softcapping"] == 30.0
    assert out["query_pre_attn_scalar"] == 256
    with pytest.raises(GGUFError, match="freq_base_swa"):
        gemma_fields(_file("gemma2", {"rope.freq_base_swa": 5.0}), {**_common(2), "rope_theta": 10000.0})


@pytest.mark.parametrize("types", [[SLIDING] * 3 + [FULL], [SLIDING, FULL] * 2, [FULL, SLIDING, SLIDING, FULL],
                                   [SLIDING] * 4, [FULL] * 4])  # fmt: skip
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_pattern_written_reads_back(types, arch):
    pattern = pattern_of(types, arch)
    if pattern is None:
        gf = _file(arch)
    elif isinstance(pattern, int):
        gf = _file(arch, {"attention.sliding_window_pattern": pattern})
    else:
        gf = _file(arch, arrays={"attention.sliding_window_pattern": pattern})
    assert layer_types_of(gf, len(types)) == types


def test_a_pattern_array_of_the_wrong_length_is_refused():
    with pytest.raises(GGUFError, match="3 entries for 4 layers"):
        layer_types_of(_file("gemma3", arrays={"attention.sliding_window_pattern": [True, True, False]}), 4)
