"""Which attention backend the engine gets, decided with fake probes (no GPU needed)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from engine import EngineConfig
from engine.attention import TorchAttentionBackend, select_backend, triton_unavailable_reason


def ok(device):
    return None


def broken(device):
    return "no ptxas"


def _triton_backend_class():
    pytest.importorskip("triton")
    from engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


def test_cpu_auto_is_the_cpu_kernels_never_triton():
    from engine.attention.cpu_backend import CpuAttentionBackend

    assert isinstance(select_backend("cpu", probe=ok), CpuAttentionBackend)
    assert isinstance(select_backend(torch.device("cpu")), CpuAttentionBackend)
    assert type(select_backend("cpu", "torch")) is TorchAttentionBackend


def test_cpu_auto_falls_back_to_the_reference_and_says_why(monkeypatch, caplog):
    from engine.kernels import cpu_kernels
    monkeypatch.setattr(cpu_kernels, "load", lambda group: "no C++ compiler")
    with caplog.at_level(logging.WARNING, logger="tokenmill.engine"):
        backend = select_backend("cpu")
    assert type(backend) is TorchAttentionBackend and "no C++ compiler" in caplog.text
    with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
        select_backend("cpu", "cpu")
    with pytest.raises(ValueError, match="CPU only"):
        select_backend("cuda", "cpu", probe=ok, num_sms=132)


def test_torch_preference_wins_everywhere():
    assert isinstance(select_backend("cuda", "torch", probe=ok, num_sms=132), TorchAttentionBackend)


def test_cuda_auto_picks_triton_when_it_can_run():
    cls = _triton_backend_class()
    backend = select_backend("cuda", "auto", torch.bfloat16, probe=ok, num_sms=132)
    assert isinstance(backend, cls)
    assert backend.supports_cuda_graphs and backend.num_sms == 132
    assert backend.tiles.prefill_m == 64  # 16-bit tiles
    fp32 = select_backend("cuda:1", "auto", torch.float32, probe=ok, num_sms=16)
    assert fp32.tiles.prefill_m == 32


def test_cuda_auto_falls_back_to_torch_and_says_why(caplog):
    with caplog.at_level(logging.WARNING, logger="tokenmill.engine"):
        backend = select_backend("cuda", "auto", probe=broken, num_sms=132)
    assert isinstance(backend, TorchAttentionBackend)
    assert "no ptxas" in caplog.text


def test_explicit_triton_that_cannot_run_raises():
    with pytest.raises(ValueError, match="no ptxas"):
        select_backend("cuda", "triton", probe=broken, num_sms=132)


def test_unknown_preference_raises():
    with pytest.raises(ValueError, match="attention_backend"):
        select_backend("cpu", "flash")


def test_probe_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET" in triton_unavailable_reason(torch.device("cpu"))
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_backend("cpu", "triton")


def test_probe_reports_an_unimportable_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    reason = triton_unavailable_reason(torch.device("cuda"))
    assert reason is not None and "cannot be imported" in reason
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "cannot be imported" in triton_unavailable_reason(torch.device("cpu"))


def test_probe_checks_compute_capability_then_builds_and_launches(monkeypatch):
    pytest.importorskip("triton")
    from engine.attention import triton_probe

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(triton_probe, "toolchain_reason", lambda: pytest.fail("probed below 8.0"))
    assert "7.5" in triton_unavailable_reason(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    launched = []
    monkeypatch.setattr(triton_probe, "toolchain_reason", lambda: None)
    monkeypatch.setattr(triton_probe, "kernel_reason", lambda device: launched.append(device))
    assert triton_unavailable_reason(torch.device("cuda")) is None and launched == [torch.device("cuda")]
    monkeypatch.setattr(triton_probe, "toolchain_reason", lambda: "no C compiler")
    assert triton_unavailable_reason(torch.device("cuda")) == "no C compiler"
    # tests/engine/test_triton_probe.py runs the real checks


def test_probe_refuses_other_devices():
    assert "mps" in triton_unavailable_reason(torch.device("mps"))


def test_config_validates_backend_and_eager_flag():
    assert EngineConfig(model="m").attention_backend == "auto"
    assert EngineConfig(model="m").enforce_eager is False
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model="m", attention_backend="flashinfer")
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(model="m", enforce_eager="yes")


def test_cpu_engine_uses_the_cpu_kernels_and_no_graphs(build_model):
    from .helpers import make_engine

    engine = make_engine(build_model("tiny-llama"))
    assert engine.runner.backend.name == "cpu"
    assert engine.runner.graphs is None
    assert engine.device_memory() is None  # device-memory numbers come from CUDA only
