"""`tokenmill convert FILE.gguf OUT_DIR`: a Hugging Face folder transformers loads, with the
dequantized weights (equal to transformers' own GGUF load), the tokenizer and the chat template."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from engine.weights.gguf.convert import convert

from .gguf_helpers import gguf_path, hf_from_gguf, hf_greedy, small_case
from .helpers import greedy, make_engine


@pytest.fixture(scope="module")
def files(build_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    path = gguf_path(build_model, root, "tiny-llama", "Q4_1")
    return path, convert(path, root / "tiny-llama-hf")


def test_transformers_loads_the_folder_with_the_dequantized_weights(files):
    from transformers import AutoModelForCausalLM

    path, folder = files
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    reference = hf_from_gguf(path)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    case = small_case(seed=11)
    assert hf_greedy(model, case.prompts, case.max_tokens).tokens == hf_greedy(reference, case.prompts,
                                                                               case.max_tokens).tokens


def test_engine_serves_folder_and_file_alike(files):
    path, folder = files
    case = small_case(seed=12)
    params = [greedy(m) for m in case.max_tokens]
    a = make_engine(path).generate(case.prompts, params)
    b = make_engine(folder).generate(case.prompts, params)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_tokenizer_files_and_chat_template(files):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path, folder = files
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # loads in transformers 4 and 5
    assert "<|im_start|>" in config["chat_template"]
    assert (folder / "chat_template.jinja").read_text() == config["chat_template"]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    from_folder = AutoTokenizer.from_pretrained(str(folder))
    from_file = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "print('hello, world')\n"
    assert from_folder.encode(text) == from_file.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert from_folder.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        from_file.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert PreTrainedTokenizerFast.from_pretrained(str(folder)).eos_token == "<|im_end|>"


def test_tied_model_and_bfloat16(build_model, tmp_path):
    path = gguf_path(build_model, tmp_path, "tiny-llama-k", "Q4_K")
    folder = convert(path, tmp_path / "out", dtype="bfloat16")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
        assert "lm_head.weight" not in st.keys()  # tied: the embedding serves as the head
        assert st.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "bfloat16"


def test_cli(files, tmp_path, capsys):
    from server import cli

    path, _ = files
    assert cli.main(["convert", str(path), str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "model.safetensors").is_file()
    assert cli.main(["convert", str(path), str(tmp_path / "a")]) == 2  # never overwrites a folder
    assert "exists and is not an empty folder" in capsys.readouterr().err
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    assert cli.main(["convert", str(bad), str(tmp_path / "b")]) == 2
    assert f"{bad}: not a GGUF file" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()  # nothing written for a bad file
