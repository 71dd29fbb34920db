"""Bad GGUF files: truncated, wrong magic, unknown tensor type, unsupported architecture. Each is a
GGUFError naming the file and the problem, raised before any weight is loaded; `tokenmill serve`
prints it on one line and exits with code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
from gguf import GGUFReader

from engine.testing.make_gguf import write_gguf
from engine.weights.gguf import GGUFError

from .gguf_helpers import gguf_path
from .helpers import make_engine


@pytest.fixture(scope="module")
def good(build_model, tmp_path_factory):
    return gguf_path(build_model, tmp_path_factory.mktemp("good"), "tiny-llama", "Q4_1")


def _truncated(good, tmp_path):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(good.read_bytes()[:-1000])
    return bad, "truncated: tensor data runs past the end of the file"


def _truncated_header(good, tmp_path):
    bad = tmp_path / "header.gguf"
    bad.write_bytes(good.read_bytes()[:5000])
    return bad, "truncated or corrupt: its metadata cannot be read"


def _wrong_magic(good, tmp_path):
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + good.read_bytes()[4:])
    return bad, "not a GGUF file: it starts with b'GGML'"


def _retyped(good, tmp_path, name: str, type_id: int):
    bad = tmp_path / name
    bad.write_bytes(good.read_bytes())
    reader = GGUFReader(bad, mode="r+")
    f32 = next(t for t in reader.tensors if t.name == "output_norm.weight")
    f32.field.parts[4][0] = type_id  # the tensor-info table's type field, written through the map
    reader.data.flush()
    del reader
    return bad


def _unknown_type(good, tmp_path):
    return _retyped(good, tmp_path, "unknown.gguf", 99), "unknown tensor type 99"


def _unsupported_type(good, tmp_path):  # a real ggml type, but not a float or quantized weight type
    return _retyped(good, tmp_path, "int8.gguf", 24), "tensor 'output_norm.weight' has type I8"


def _unsupported_arch(build_model, tmp_path):
    bad = write_gguf(build_model("tiny-llama"), tmp_path / "gpt2.gguf", "Q8_0", arch="gpt2")
    return bad, ("unsupported architecture 'gpt2' (supported: llama, mistral, qwen2, qwen3, granite, olmo2, phi3, "
                 "smollm3, gemma2, gemma3, qwen3moe, qwen2moe, olmoe, gpt-oss, lfm2)")


CASES = [_truncated, _truncated_header, _wrong_magic, _unknown_type, _unsupported_type]


@pytest.fixture(params=[*CASES, _unsupported_arch], ids=lambda f: f.__name__.strip("_"))
def bad_file(request, good, build_model, tmp_path):
    maker = request.param
    return maker(build_model, tmp_path) if maker is _unsupported_arch else maker(good, tmp_path)


def test_engine_names_file_and_problem_and_loads_nothing(bad_file, monkeypatch):
    import engine.engine

    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded from a bad file")

    monkeypatch.setattr(engine.engine, "load_model", no_load)
    path, problem = bad_file
    with pytest.raises(GGUFError) as info:
        make_engine(path)
    assert str(path) in str(info.value) and problem in str(info.value)


def test_serve_exits_2_with_one_clear_line(bad_file, monkeypatch, capsys):
    from server import cli

    monkeypatch.setattr(cli, "configure_logging", lambda *args: None)  # keep the test process's logging
    path, problem = bad_file
    assert cli.main(["serve", "--model", str(path), "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tokenmill serve: cannot load the model: ")
    assert str(path) in err[-1] and problem in err[-1]


def test_server_process_exit_code_is_2(good, tmp_path):
    path, problem = _truncated(good, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "server", "--model", str(path), "--port", "0"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"{path}: {problem}" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("keep", [("rope_factors_long.weight",), ("rope_factors_long.weight", "rope_factors_short.weight")])
def test_longrope_factor_tensors_are_checked(build_model, tmp_path, monkeypatch, keep):
    """A phi3 file with one LongRoPE factor tensor is a GGUFError naming the other; a factor tensor
    whose length is not the rotary dims / 2 one naming the tensor."""
    import numpy as np

    from engine.testing import make_gguf

    written = make_gguf._longrope_tensors

    def altered(w, c):
        tensors = {k: v for k, v in written(w, c).items() if k in keep}
        return tensors if len(keep) == 1 else {k: np.concatenate([v, v]) for k, v in tensors.items()}

    monkeypatch.setattr(make_gguf, "_longrope_tensors", altered)
    path = write_gguf(build_model("tiny-phi3-longrope"), tmp_path / "bad.gguf", "F32")
    want = "rope_factors_short.weight is missing" if len(keep) == 1 else "expected 12 float32 values"
    with pytest.raises(GGUFError, match=want):
        make_engine(path)
