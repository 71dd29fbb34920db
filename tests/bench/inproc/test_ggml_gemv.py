"""bench ggml-gemv: the bf16 kernel against the GGUF block kernels (float and int8 activations) per
type, shape and row count; K-quant types skip shapes whose K is not a multiple of 256."""

from __future__ import annotations

import pytest

from bench.cli import main
from engine.kernels import cpu_kernels
from engine.models.cpu_linear import kernels_unavailable


@pytest.mark.skipif(kernels_unavailable("bf16") is not None or cpu_kernels.load("ggml") is not None,
                    reason="the bf16 / ggml kernels cannot run here")
def test_ggml_gemv_cli_times_every_type_and_shape(capsys):
    assert main(["ggml-gemv", "--types", "Q4_1", "Q4_K", "--shapes", "64x96", "32x256", "--rows", "1", "3",
                 "--layers", "2", "--repeats", "2"]) == 0
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.split()[:1] in (["Q4_1"], ["Q4_K"])]
    assert [(r[0], r[1], r[2]) for r in lines] == [("Q4_1", "64x96", "1"), ("Q4_1", "64x96", "3"), ("Q4_1", "32x256", "1"),
                                                  ("Q4_1", "32x256", "3"), ("Q4_K", "32x256", "1"), ("Q4_K", "32x256", "3")]
    for r in lines:
        bf16, f32, q8, ratio = (float(v) for v in r[3:7])
        assert min(bf16, f32, q8) > 0 and abs(ratio - bf16 / q8) < 0.01 * ratio + 0.01
