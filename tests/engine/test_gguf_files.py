"""GGUF pieces one by one: dequantization of every supported type against an independent
implementation, the Q/K row permutation, the INT8 seam, metadata -> config, the tokenizer and stop
tokens, and what a model path resolves to."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.testing.make_gguf import quantize_q4_k
from engine.weights.gguf import dequant
from engine.weights.gguf.config import hf_config
from engine.weights.gguf.reader import open_gguf
from engine.weights.gguf.tensors import gguf_name, hf_name, permute, unpermute
from engine.weights.gguf.tokenizer import eos_token_ids, load_tokenizer
from engine.weights.model_open import open_model_source

from .gguf_helpers import gguf_path

# Byte offsets of the float16 fields in each block (ggml's block structs); the rest is quant bits.
_FP16_AT = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q2_K: [80, 82],
            Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}  # fmt: skip


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-files")


def _random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid random data: random quant bits, finite float16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in _FP16_AT[qtype]:
        data[:, at : at + 2] = rng.uniform(-0.05, 0.05, (len(data), 1)).astype(np.float16).view(np.uint8)
    return data.reshape(rows, cols // block * size)


def _file_with(path, tensors: dict[str, tuple[np.ndarray, Q | None]]):
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, raw) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return open_gguf(path)


# transformers' torch dequantization has no MXFP4: test_mxfp4_dequantization_matches_the_format below
@pytest.mark.parametrize("qtype", sorted(dequant.QUANTIZED_TYPES - {Q.Q5_0, Q.Q5_1, Q.MXFP4}, key=lambda q: q.value),
                         ids=lambda q: q.name)
def test_dequantization_matches_transformers_torch_implementation(tmp_path, qtype):
    """Read back from a file through the engine's path (reader -> to_torch) vs transformers' own torch
    dequantization (a separate implementation of ggml's formats)."""
    ref_dequant = pytest.importorskip("transformers.integrations.gguf.dequant")  # transformers >= 5.x
    rows, cols = 6, 512
    data = _random_blocks(qtype, rows, cols, seed=qtype.value)
    gf = _file_with(tmp_path / "q.gguf", {"w": (data, qtype)})
    ours = dequant.to_torch(gf.tensors[0])
    theirs = ref_dequant.dequantize(torch.from_numpy(data.reshape(-1).copy()), qtype.value).reshape(rows, cols)
    assert ours.shape == (rows, cols) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_mxfp4_dequantization_matches_the_format(tmp_path):
    """MXFP4 (GPT-OSS's experts) read back through the engine's path against the OCP format written out
    here: per 32 values one E8M0 scale byte e (2^(e - 127)), then 16 bytes of E2M1 codes, the low nibbles
    the block's first 16 values, the high nibbles the next 16."""
    rng = np.random.default_rng(39)
    rows, cols = 4, 128
    scales = rng.integers(118, 134, (rows, cols // 32, 1), dtype=np.uint8)
    codes = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    data = np.concatenate([scales, codes], axis=-1).reshape(rows, -1)
    gf = _file_with(tmp_path / "mx.gguf", {"w": (data, Q.MXFP4)})
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
    nibbles = np.concatenate([codes & 0x0F, codes >> 4], axis=-1)  # [rows, blocks, 32]
    want = (e2m1[nibbles] * np.exp2(scales.astype(np.float32) - 127)).reshape(rows, cols)
    assert np.array_equal(dequant.to_torch(gf.tensors[0]).numpy(), want)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_quantized_roundtrip_is_close(tmp_path, qtype):
    x = np.random.default_rng(1).normal(0, 0.1, (4, 256)).astype(np.float32)
    gf = _file_with(tmp_path / "r.gguf", {"w": (gguf.quants.quantize(x, qtype), qtype)})
    got = dequant.to_torch(gf.tensors[0]).numpy()
    step = (x.max() - x.min()) / (2 ** {Q.Q5_0: 5, Q.Q5_1: 5, Q.Q8_0: 8, Q.Q4_0: 4}[qtype])
    assert np.abs(got - x).max() <= step


def test_float_types_are_viewed_without_copy(tmp_path):
    x = np.random.default_rng(2).normal(size=(3, 64)).astype(np.float32)
    bf16 = gguf.quants.quantize(x, Q.BF16)
    gf = _file_with(tmp_path / "f.gguf", {"a": (x, None), "b": (x.astype(np.float16), None), "c": (bf16, Q.BF16)})
    a, b, c = (dequant.to_torch(t) for t in gf.tensors)
    assert (a.dtype, b.dtype, c.dtype) == (torch.float32, torch.float16, torch.bfloat16)
    assert a.shape == b.shape == c.shape == (3, 64)
    torch.testing.assert_close(a, torch.from_numpy(x), rtol=0, atol=0)
    torch.testing.assert_close(c.float(), torch.from_numpy(x).bfloat16().float(), rtol=0, atol=0)
    for t, tensor in zip(gf.tensors, (a, b, c), strict=True):  # shares memory with the file map
        assert tensor.data_ptr() == t.data.ctypes.data


def test_chunked_dequantization_equals_one_call(tmp_path, monkeypatch):
    data = _random_blocks(Q.Q4_1, 40, 96)
    gf = _file_with(tmp_path / "c.gguf", {"w": (data, Q.Q4_1)})
    monkeypatch.setattr(dequant, "_CHUNK_VALUES", 96 * 3)  # 3 rows per call: 14 calls
    got = dequant.to_torch(gf.tensors[0])
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(data, Q.Q4_1)))


def test_q8_0_blocks_give_the_dequantized_values(tmp_path):
    """The INT8 seam: int8 values and per-32 scales as stored, scale * q == the dequantized value."""
    data = _random_blocks(Q.Q8_0, 5, 128)
    gf = _file_with(tmp_path / "q8.gguf", {"w": (data, Q.Q8_0)})
    values, scales = dequant.q8_0_blocks(gf.tensors[0])
    assert values.dtype == np.int8 and values.shape == (5, 128)
    assert scales.dtype == np.float16 and scales.shape == (5, 4)
    rebuilt = scales.astype(np.float32).repeat(32, axis=1) * values.astype(np.float32)
    assert np.array_equal(rebuilt, dequant.to_torch(gf.tensors[0]).numpy())


def test_int8_seam_gives_q8_0_rows_in_hf_layout(build_model, gguf_dir):
    """GGUFWeights.stored + q8_0_blocks + unpermute: int8 rows and scales of a permuted Q8_0 matrix that
    multiply out to exactly the weight the engine loads."""
    src = open_model_source(gguf_path(build_model, gguf_dir, "tiny-llama", "Q8_0"))
    t, heads = src.weights.stored("blk.0.attn_q.weight")
    assert heads == 4  # tiny-llama's query heads: llama.cpp permuted these rows
    values, scales = dequant.q8_0_blocks(t)
    values, scales = unpermute(values, heads), unpermute(scales, heads)
    rebuilt = scales.astype(np.float32).repeat(32, axis=1) * values.astype(np.float32)
    assert np.array_equal(rebuilt, src.weights.tensor("blk.0.attn_q.weight").numpy())
    assert src.weights.stored("blk.0.ffn_up.weight")[1] is None


def test_q4_k_test_quantizer_is_close():
    """make_gguf's Q4_K encoder (the K-quant test files rely on it) roundtrips within one step."""
    x = np.random.default_rng(3).normal(0, 0.1, (8, 512)).astype(np.float32)
    y = gguf.quants.dequantize(quantize_q4_k(x), Q.Q4_K)
    sub = x.reshape(-1, 32)
    step = ((sub.max(1) - np.minimum(sub.min(1), 0)) / 15).max()
    assert np.abs(y - x).max() <= step


def test_unpermute_inverts_llama_cpp_permutation():
    # one head of 4 rows: HF rotates halves (rows 0,1 | 2,3); llama.cpp stores pairs (0,2), (1,3)
    hf = torch.arange(4.0).reshape(4, 1)
    assert permute(hf, 1).flatten().tolist() == [0.0, 2.0, 1.0, 3.0]
    x = torch.randn(3 * 8, 5)  # 3 heads of 8 rows
    assert torch.equal(unpermute(permute(x, 3), 3), x)
    assert not torch.equal(permute(x, 3), x)
    rows = np.arange(16 * 3, dtype=np.uint8).reshape(16, 3)  # raw rows (e.g. quantized blocks) too
    assert np.array_equal(unpermute(permute(rows, 2), 2), rows)
    with pytest.raises(ValueError, match="heads"):
        unpermute(torch.zeros(6, 2), 2)


def test_tensor_names_map_both_ways():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.7.attn_k.bias") == "model.layers.7.self_attn.k_proj.bias"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert hf_name("blk.0.ffn_gate_exps.weight") == "model.layers.0.mlp.experts.gate_proj.weight"  # stacked [E, I, H]
    assert hf_name("blk.0.ffn_gate_inp_shexp.weight") == "model.layers.0.mlp.shared_expert_gate.weight"
    assert hf_name("blk.0.ssm_conv1d.weight") is None  # Mamba layers: no place in our models
    assert gguf_name("model.layers.3.post_attention_layernorm.weight") == "blk.3.ffn_norm.weight"


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-llama-k",
                                    "tiny-granite", "tiny-olmo2", "tiny-phi3", "tiny-smollm3", "tiny-phi3-longrope"])
def test_config_from_metadata_matches_the_source_config(build_model, gguf_dir, preset):
    from transformers import AutoConfig

    path = gguf_path(build_model, gguf_dir, preset, "F32")
    ours, source = hf_config(open_gguf(path)), AutoConfig.from_pretrained(str(build_model(preset)))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "eos_token_id", "bos_token_id"):  # fmt: skip
        assert getattr(ours, key) == getattr(source, key), key
    assert ours.rms_norm_eps == pytest.approx(source.rms_norm_eps, rel=1e-6)  # stored as float32
    expected = "LlamaForCausalLM" if preset == "tiny-mistral" else source.architectures[0]
    assert ours.architectures == [expected]  # llama.cpp writes Mistral as llama
    if preset == "tiny-granite":  # the four multipliers, from granite.embedding_scale etc.
        for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            assert getattr(ours, key) == pytest.approx(getattr(source, key), rel=1e-6), key
    if preset == "tiny-smollm3":  # no key in the file: llama.cpp's fixed every-4th-layer NoPE
        assert ours.no_rope_layers == source.no_rope_layers == [1, 1, 1, 0]
    if preset in ("tiny-phi3", "tiny-phi3-longrope"):  # rope.dimension_count 24 of 32
        assert ours.rope_parameters["partial_rotary_factor"] == source.rope_parameters["partial_rotary_factor"] == 0.75
    if preset == "tiny-phi3-longrope":  # rope_factors_long/short.weight, rope.scaling.original_context_length
        assert ours.rope_parameters["rope_type"] == source.rope_parameters["rope_type"] == "longrope"
        for key in ("long_factor", "short_factor", "original_max_position_embeddings"):
            assert ours.rope_parameters[key] == pytest.approx(source.rope_parameters[key], rel=1e-7), key
        assert "attention_factor" not in ours.rope_parameters  # llama.cpp's value is transformers' default
        assert ours.original_max_position_embeddings == 32


def test_tokenizer_and_chat_template_from_metadata(build_model, gguf_dir):
    from transformers import AutoTokenizer

    gf = open_gguf(gguf_path(build_model, gguf_dir, "tiny-llama", "F32"))
    ours, source = load_tokenizer(gf), AutoTokenizer.from_pretrained(str(build_model("tiny-llama")))
    text = "def main():\n    return {'a': 1}  # ok, 2 + 2 = 4"
    assert ours.encode(text, add_special_tokens=False) == source.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    chat = [{"role": "user", "content": "Hello there"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        source.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.convert_tokens_to_ids("<|im_end|>") == 2
    assert ours.encode("<|im_start|>user", add_special_tokens=False)[0] == 1  # special tokens stay whole
    assert eos_token_ids(gf, ours) == frozenset({2})
    auto = AutoTokenizer.from_pretrained(str(gf.path.parent), gguf_file=gf.path.name)  # transformers' pick
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert ours.chat_template == auto.chat_template and ours.eos_token == auto.eos_token


def test_model_paths_resolve(build_model, gguf_dir, tmp_path):
    path = gguf_path(build_model, gguf_dir, "tiny-llama", "Q8_0")
    src = open_model_source(path)
    assert (src.format, src.name, src.path) == ("gguf", "tiny-llama.Q8_0", path)
    assert len(src.weights) == 21 and src.eos_token_ids == frozenset({2})
    folder = tmp_path / "my-model"
    folder.mkdir()
    shutil.copy(path, folder / path.name)
    assert (open_model_source(folder).format, open_model_source(folder).name) == ("gguf", "my-model")
    shutil.copy(path, folder / "second.gguf")
    with pytest.raises(ValueError, match="2 .gguf files"):
        open_model_source(folder)
    hf = open_model_source(build_model("tiny-llama"))
    assert (hf.format, hf.name) == ("safetensors", "tiny-llama")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        open_model_source(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match="does not exist"):
        open_model_source(tmp_path / "nowhere")


def test_long_arrays_are_stepped_over_and_the_tokenizer_is_unchanged(build_model, gguf_dir, tmp_path):
    """A vocabulary past the reader's array limit (49,152 tokens and types) is stepped over in one pass,
    not read item by item: the metadata, the array lengths and the tensors equal what gguf's own reader
    gives, and the tokenizer built from the file encodes as the source folder's does. A file cut inside
    the token list is a clear error."""
    from transformers import AutoTokenizer

    from engine.weights.gguf import reader as ours

    path = gguf_path(build_model, gguf_dir, "tiny-llama-wide", "F32")
    gf = open_gguf(path)
    plain = gguf.GGUFReader(path)  # gguf's reader, every array read item by item
    assert gf.array_lengths["tokenizer.ggml.tokens"] == gf.array_lengths["tokenizer.ggml.token_type"] == 49152
    assert len(plain.fields["tokenizer.ggml.tokens"].data) == 49152
    for key, f in plain.fields.items():
        if f.types and f.types[0] != gguf.GGUFValueType.ARRAY and not key.startswith("GGUF."):
            assert gf.metadata[key] == f.contents(), key
        elif f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
            assert gf.array_lengths[key] == len(f.data), key
    assert [(t.name, t.data_offset, t.n_bytes) for t in gf.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in plain.tensors]
    long = [f for f in ours._Reader(path).fields.values() if f.types and f.types[0] == gguf.GGUFValueType.ARRAY]
    assert {f.name for f in long if not f.data} == {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type"}
    source = AutoTokenizer.from_pretrained(str(build_model("tiny-llama-wide")))
    mine = load_tokenizer(gf)
    for text in ("def main():\n    return {'a': 1}", "  two  spaces\tand tabs", "日本語 😀 ½ €", "<|im_start|>user\nhi"):
        assert mine.encode(text, add_special_tokens=False) == source.encode(text, add_special_tokens=False), text
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    at = data.index(b"[PAD40000]")  # inside the token list
    cut.write_bytes(data[:at])
    with pytest.raises(ours.GGUFError, match="truncated or corrupt: its metadata cannot be read"):
        open_gguf(cut)
