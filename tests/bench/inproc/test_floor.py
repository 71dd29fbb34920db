"""bench floor: the decode engine really decodes, and the floor times the model's own linears."""

from __future__ import annotations

import json

from bench.cli import main
from bench.inproc.floor import decode_engine, time_attention_products, time_matmuls, time_steps


def test_decode_engine_steps_are_pure_decodes(build_model):
    engine = decode_engine(str(build_model("tiny-llama")), "float32", batch=3, context=20, max_tokens=12)
    runs = time_steps(engine, 4)
    assert len(runs) == 4 and all(r > 0 for r in runs)
    st = engine.stats()
    assert st.running == 3 and st.last_step_decode_tokens == 3 and st.last_step_prefill_tokens == 0
    assert len(time_matmuls(engine.runner.model, 3, 2)) == 2
    assert len(time_attention_products(engine.runner.model, 3, 32, 2)) == 2


def test_floor_cli_writes_json(build_model, tmp_path):
    out = tmp_path / "floor.json"
    rc = main(["floor", "--model", str(build_model("tiny-llama")), "--dtype", "float32", "--batch", "2", "4",
               "--context", "16", "--repeats", "3", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res] == [2, 4]
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 and len(r["step_runs_ms"]) == 3 for r in res)
    assert all(abs(r["ratio"] - r["step_ms"] / r["floor_ms"]) < 1e-9 for r in res)
    assert all(r["attn_ms"] > 0 for r in res)
    assert all(abs(r["ratio_with_attn"] - r["step_ms"] / (r["floor_ms"] + r["attn_ms"])) < 1e-9 for r in res)


def test_compile_switch_compiles_norms_and_mlps(build_model):
    from bench.inproc.floor import measure

    res = measure(str(build_model("tiny-llama")), "float32", batch=2, context=8, repeats=2, compile_=True)
    assert res.step_ms > 0 and res.floor_ms > 0 and len(res.step_runs_ms) == 2


def test_bandwidth_floor_and_int8(build_model, tmp_path):
    """The bandwidth floor is the served weight bytes over the measured read bandwidth; INT8 halves
    the bytes (float32 here: a quarter), and the matmul floor times each product of the step once."""
    from bench.inproc.floor import step_linears

    path = str(build_model("tiny-llama"))
    res = {}
    for name, extra in (("plain", []), ("int8", ["--quantization", "int8"])):
        out = tmp_path / f"{name}.json"
        assert main(["floor", "--model", path, "--dtype", "float32", "--batch", "2", "--context", "16",
                     "--repeats", "2", "--json", str(out), *extra]) == 0
        res[name] = json.loads(out.read_text())[0]
    for r in res.values():
        assert r["read_gbps"] > 0 and r["weight_bytes"] > 0
        assert abs(r["bandwidth_floor_ms"] - r["weight_bytes"] / (r["read_gbps"] * 1e9) * 1e3) < 1e-9
        assert abs(r["ratio_bandwidth"] - r["step_ms"] / r["bandwidth_floor_ms"]) < 1e-9
    assert res["int8"]["weight_bytes"] < res["plain"]["weight_bytes"] / 3  # int8 + scales vs float32
    plain = decode_engine(path, "float32", batch=1, context=8, max_tokens=4)
    int8 = decode_engine(path, "float32", batch=1, context=8, max_tokens=4, quantization="int8")
    assert len(step_linears(plain.runner.model)) == len(step_linears(int8.runner.model)) == 2 * 4 + 1
