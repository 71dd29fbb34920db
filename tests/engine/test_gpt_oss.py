"""GPT-OSS's pieces against transformers' own modules (engine/models/gpt_oss.py): the YaRN rotary tables,
the MoE block (router bias, softmax over the top-k logits, the clamped SwiGLU with biases) on random
routing, the engine's CPU linears in the experts, and the start-up with its sinks (C++ attention on the
CPU). Whole-model parity: tests/engine/test_parity.py (MOE_PRESETS); GGUF with MXFP4 experts:
tests/engine/test_gguf_moe.py."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss import modeling_gpt_oss as hf

from engine.models.gpt_oss import GptOssMoeBlock, clamped_swiglu
from engine.models.rope import rotary_embedding

from .helpers import make_engine


def _config(**kw) -> GptOssConfig:
    base = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                vocab_size=100, max_position_embeddings=512, sliding_window=8,
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})
    base.update(kw)
    return GptOssConfig(**base)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_tables_match_transformers(truncate):
    cfg = _config()
    cfg.rope_parameters["truncate"] = truncate
    ours = rotary_embedding(cfg, 16, 512)
    ours.build(torch.float32, torch.device("cpu"))
    theirs = hf.GptOssRotaryEmbedding(cfg)
    pos = torch.arange(512)[None, :]
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), pos)  # [1, 512, D / 2]
    assert theirs.attention_scaling != 1.0  # YaRN's factor on cos/sin is in play
    torch.testing.assert_close(ours.cos[:, :8], cos[0], rtol=0, atol=0)
    torch.testing.assert_close(ours.sin[:, 8:], sin[0], rtol=0, atol=0)


def _blocks(seed: int):
    cfg = _config()
    torch.manual_seed(seed)
    theirs = hf.GptOssMLP(cfg).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.5)
    ours = GptOssMoeBlock(cfg).eval()
    ours.gate.weight.data.copy_(theirs.router.weight)
    ours.gate.bias.data.copy_(theirs.router.bias)
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        getattr(ours.experts, name).data.copy_(getattr(theirs.experts, name))
    return cfg, theirs, ours


def test_moe_block_matches_transformers():
    cfg, theirs, ours = _blocks(0)
    x = torch.randn(37, cfg.hidden_size) * 2  # large enough that the clamps bite
    with torch.no_grad():
        want = theirs(x[None])[0][0]
        got = ours(x)
        gate_up = x @ theirs.experts.gate_up_proj[0] + theirs.experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > cfg.swiglu_limit).any()  # the clamp matters on these values
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # outputs of size ~1: float32 sums' order
    # one token alone: most experts get none
    with torch.no_grad():
        torch.testing.assert_close(ours(x[:1]), theirs(x[None, :1])[0][0], rtol=1e-4, atol=1e-4)


def test_expert_linears_keep_the_answer():
    """The CPU kernels' per-expert linears (bias included, role linear) give the stacked product's answer."""
    cfg, _, ours = _blocks(1)
    x = torch.randn(9, cfg.hidden_size)
    with torch.no_grad():
        want = ours(x)
        roles = []

        def make(w, b, role):
            roles.append(role)
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
            lin.weight.data.copy_(w)
            if b is not None:
                lin.bias.data.copy_(b)
            return lin

        ours.experts.replace_linears(make)
        got = ours(x)
    assert set(roles) == {"linear"} and ours.experts.gate_up_proj.numel() == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_clamped_swiglu_is_transformers_gate():
    cfg = _config()
    experts = hf.GptOssExperts(cfg)
    gu = torch.randn(5, 2 * cfg.intermediate_size) * 10
    torch.testing.assert_close(clamped_swiglu(gu, cfg.swiglu_alpha, cfg.swiglu_limit), experts._apply_gate(gu))


def test_engine_serves_it_with_sinks_on_the_cpu_kernels(build_model):
    engine = make_engine(build_model("tiny-gpt-oss"))
    model = engine.runner.model
    assert engine.runner.backend.name == "cpu" and model.attention_sinks
    windows = [layer.self_attn.window for layer in model.model.layers]
    assert windows == [24, None]  # sliding then full, from layer_types
    assert model.model.fused_decode is None and model.cuda_graphs_unsupported() is not None
