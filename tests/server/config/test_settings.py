"""Settings: YAML, then TOKENMILL_* env, then flags; --help lists every flag with its default;
the shipped configs load; `tokenmill bench` dispatches to bench.cli."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.config import EngineConfig
from server import cli
from server.config.flags import parse_settings
from server.config.lanes import Lane
from server.config.settings import ServerSettings
from server.http.connections import FD_RESERVE

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("TOKENMILL_MAX_NUM_SEQS", "TOKENMILL_CONFIG", "TOKENMILL_API_KEYS", "TOKENMILL_PORT",
                 "TOKENMILL_ADMIN_API_KEYS"):
        monkeypatch.delenv(name, raising=False)


def test_yaml_then_env_then_flags(tmp_path, monkeypatch):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("max_num_seqs: 3\ndtype: bfloat16\nport: 9001\n")
    s = parse_settings(["--config", str(cfg)])
    assert (s.max_num_seqs, s.dtype, s.port) == (3, "bfloat16", 9001)
    monkeypatch.setenv("TOKENMILL_MAX_NUM_SEQS", "5")
    s = parse_settings(["--config", str(cfg)])
    assert (s.max_num_seqs, s.port) == (5, 9001)
    s = parse_settings(["--config", str(cfg), "--max-num-seqs", "7"])
    assert (s.max_num_seqs, s.dtype) == (7, "bfloat16")
    monkeypatch.setenv("TOKENMILL_CONFIG", str(cfg))  # the file can come from the environment too
    assert parse_settings([]).port == 9001


def test_defaults_bind_loopback():
    s = ServerSettings()
    assert s.host == "127.0.0.1" and s.model is None and s.drain_timeout_s == 30
    assert s.short_request_tokens == 512


def test_bad_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        parse_settings(["--config", str(tmp_path / "missing.yaml")])
    typo = tmp_path / "typo.yaml"
    typo.write_text("max_num_seq: 3\n")
    with pytest.raises(ValidationError, match="max_num_seq"):
        parse_settings(["--config", str(typo)])
    with pytest.raises(ValidationError, match="max_num_seqs"):
        parse_settings(["--max-num-seqs", "0"])
    with pytest.raises(SystemExit):
        parse_settings(["--dtype", "int4"])


def test_value_forms():
    s = parse_settings(["--kv-cache-memory", "512MiB", "--max-model-len", "none", "--no-enable-prefix-caching",
                        "--interactive-timeout-s", "2.5"])
    assert s.kv_cache_memory == 512 * 2**20 and s.max_model_len is None and not s.enable_prefix_caching
    assert s.lane_deadlines(Lane.INTERACTIVE).total_s == 2.5
    assert parse_settings(["--kv-cache-memory", "2GB"]).kv_cache_memory == 2 * 10**9
    assert parse_settings(["--kv-cache-memory", "1048576"]).kv_cache_memory == 2**20


def test_api_keys_from_flag_and_env(monkeypatch):
    monkeypatch.setenv("TOKENMILL_API_KEYS", "k2, k3,,")
    s = parse_settings(["--api-key", "k1"])
    assert s.accepted_api_keys() == ("k1", "k2", "k3")
    monkeypatch.delenv("TOKENMILL_API_KEYS")
    assert ServerSettings().accepted_api_keys() == ()


def test_engine_config_and_lane_bounds():
    s = parse_settings(["--dtype", "float32", "--max-num-seqs", "9", "--block-size", "8",
                        "--batch-max-queued-tokens", "123"])
    cfg = s.engine_config("/models/x")
    assert isinstance(cfg, EngineConfig)
    assert (cfg.model, cfg.dtype, cfg.max_num_seqs, cfg.block_size) == ("/models/x", "float32", 9, 8)
    assert s.lane_bounds()[Lane.BATCH].max_tokens == 123


def test_quantization_and_engine_threads(monkeypatch):
    from engine.config import (
        threads as engine_threads,  # the engine sizes its threads (engine/config/threads.py)
    )

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = parse_settings(["--quantization", "int8", "--engine-threads", "3"]).engine_config("/m")
    assert (cfg.quantization, cfg.cpu_threads) == ("int8", 3)
    assert parse_settings([]).engine_config("/m").quantization is None
    assert parse_settings([]).engine_config("/m").gguf_activations == "mixed"
    assert parse_settings(["--gguf-activations", "float"]).engine_config("/m").gguf_activations == "float"
    assert [parse_settings(["--quantization", q]).engine_config("/m").quantization for q in ("gguf", "none")] == [
        "gguf", "none"]
    with pytest.raises(SystemExit):
        parse_settings(["--quantization", "int4"])
    with pytest.raises(ValidationError, match="engine_threads"):
        parse_settings(["--engine-threads", "0"])
    # Default: every core up to 4, then one left to the HTTP side, unless OMP_NUM_THREADS says.
    monkeypatch.setattr(engine_threads, "CGROUP_CPU_MAX", "/no/such/cpu.max")  # no container limit
    monkeypatch.setattr(engine_threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert parse_settings([]).engine_config("/m").cpu_threads == 2
    monkeypatch.setattr(engine_threads.os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    assert parse_settings([]).engine_config("/m").cpu_threads == 4
    monkeypatch.setattr(engine_threads.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert parse_settings([]).engine_config("/m").cpu_threads == 7
    monkeypatch.setattr(engine_threads.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert parse_settings([]).engine_config("/m").cpu_threads == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert parse_settings([]).engine_config("/m").cpu_threads == 3


def test_engine_threads_respect_a_container_cpu_limit(monkeypatch, tmp_path):
    from engine.config import (
        threads as engine_threads,  # the engine sizes its threads (engine/config/threads.py)
    )

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(engine_threads.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(engine_threads, "CGROUP_CPU_MAX", str(cpu_max))
    for text, want in (("200000 100000\n", 2), ("150000 100000", 2), ("max 100000", 63), ("800000 100000", 7),
                       ("garbage", 63)):  # fmt: skip
        cpu_max.write_text(text)
        assert parse_settings([]).engine_config("/m").cpu_threads == want, text


def test_help_lists_every_setting_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in ServerSettings.model_fields:
        assert "--" + name.replace("_", "-") in text
    for fragment in ("(default: 64)", "(default: 127.0.0.1)", "--kv-cache-memory", "--gpu-memory-utilization",
                     "--api-key", "(default: auto)", "--drain-timeout-s"):
        assert fragment in text


@pytest.mark.parametrize("name", ["cpu.yaml", "gpu.yaml"])
def test_shipped_configs_load(name):
    s = parse_settings(["--config", str(CONFIGS / name)])
    assert s.engine_config("/m").device == ("cpu" if name == "cpu.yaml" else "cuda")


def test_bench_subcommand_dispatches(monkeypatch):
    seen = {}

    class FakeBench:
        @staticmethod
        def main(argv):
            seen["argv"] = argv
            return 0

    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: FakeBench)
    assert cli.main(["bench", "offline", "--x", "1"]) == 0
    assert seen["argv"] == ["offline", "--x", "1"]
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    assert cli.main(["bench"]) == 2


def test_invalid_settings_exit_2(capsys):
    assert cli.main(["serve", "--max-num-seqs", "-1"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["flag", "env", "env_list", "yaml_list", "whitespace"])
def test_an_empty_api_key_refuses_to_start(source, tmp_path, monkeypatch, capsys):
    """An empty key would let `Authorization: Bearer ` in, or switch auth off unnoticed: exit 2."""
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    argv = ["serve"]
    if source == "flag":
        argv += ["--api-key", ""]
    elif source == "env":
        monkeypatch.setenv("TOKENMILL_API_KEY", "")
    elif source == "env_list":
        monkeypatch.setenv("TOKENMILL_API_KEYS", " , ")
    elif source == "yaml_list":
        cfg = tmp_path / "s.yaml"
        cfg.write_text('api_keys: ["", "k2"]\n')
        argv += ["--config", str(cfg)]
    else:
        argv += ["--api-key", "k1 k2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "invalid settings" in err and "API keys must not" in err


@pytest.mark.parametrize("source", ["flag", "env", "env_list", "yaml_list", "yaml_string", "whitespace"])
def test_an_empty_admin_key_refuses_to_start(source, tmp_path, monkeypatch, capsys):
    """`--admin-api-keys ""` (or an empty TOKENMILL_ADMIN_API_KEYS, which docker-compose passes through)
    would open the admin API to `Authorization: Bearer`: exit 2 naming the setting, as for API keys."""
    argv = ["serve"]
    if source == "flag":
        argv += ["--admin-api-keys", ""]
    elif source == "env":
        monkeypatch.setenv("TOKENMILL_ADMIN_API_KEYS", "")
    elif source == "env_list":
        monkeypatch.setenv("TOKENMILL_ADMIN_API_KEYS", "adm, ,")
    elif source in ("yaml_list", "yaml_string"):
        cfg = tmp_path / "s.yaml"
        cfg.write_text('admin_api_keys: ["adm", " "]\n' if source == "yaml_list" else 'admin_api_keys: ""\n')
        argv += ["--config", str(cfg)]
    else:
        argv += ["--admin-api-keys", "adm,a b"]
    if source == "env_list":  # stray commas are ignored, as for api_keys: this one is valid
        assert parse_settings([]).accepted_admin_keys() == ("adm",)
        return
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "invalid settings" in err and "admin_api_keys" in err and "admin API keys must not" in err


def test_admin_keys_from_flag_env_and_yaml(tmp_path, monkeypatch):
    assert ServerSettings().accepted_admin_keys() == ()  # unset: the admin API is off
    assert parse_settings(["--admin-api-keys", "a1,a2,a1"]).accepted_admin_keys() == ("a1", "a2")
    monkeypatch.setenv("TOKENMILL_ADMIN_API_KEYS", "e1")
    assert parse_settings([]).accepted_admin_keys() == ("e1",)


def test_connection_limits_from_settings():
    s = parse_settings(["--header-timeout-s", "3", "--body-timeout-s", "4", "--keep-alive-timeout-s", "5",
                        "--write-timeout-s", "6", "--socket-send-buffer-bytes", "65536"])
    limits = s.connection_limits(open_files=1024)
    assert (limits.header_timeout_s, limits.body_timeout_s, limits.keep_alive_timeout_s, limits.write_timeout_s,
            limits.send_buffer_bytes) == (3, 4, 5, 6, 65536)  # fmt: skip
    assert limits.max_connections == 1024 - FD_RESERVE == 896  # default: what the open-files limit leaves
    assert parse_settings(["--max-connections", "10"]).connection_limits(1024).max_connections == 10
    for flag in ("--header-timeout-s", "--write-timeout-s", "--max-connections", "--stream-max-pending-tokens"):
        with pytest.raises(ValidationError):
            parse_settings([flag, "0"])


def test_speculative_config_flag_as_vllm_spells_it(monkeypatch):
    """`--speculative-config` takes vLLM's JSON (flag or TOKENMILL_SPECULATIVE_CONFIG); the engine gets
    a SpeculativeConfig; a bad key or method is refused naming it; off by default."""
    assert parse_settings([]).engine_config("/m").speculative is None
    js = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}'
    spec = parse_settings(["--speculative-config", js]).engine_config("/m").speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == ("ngram", 3, 5, 2)
    monkeypatch.setenv("TOKENMILL_SPECULATIVE_CONFIG", '{"num_speculative_tokens": 2}')
    assert parse_settings([]).engine_config("/m").speculative.num_speculative_tokens == 2
    from server.config.vllm_flags import flag_problems

    serve_parser = cli.build_parsers()[1]
    assert flag_problems(serve_parser, ["--speculative-config", js]) is None  # no longer "vLLM only"
    for bad, word in (('{"method": "eagle"}', "method"), ('{"num_speculative_tokenz": 2}', "unknown keys"),
                      ("{not json", "speculative_config")):  # fmt: skip
        with pytest.raises(ValidationError, match=word):
            parse_settings(["--speculative-config", bad])


def test_deterministic_flag_reaches_the_engine_config():
    """--deterministic turns on the engine's batch-invariant mode; it is off by default."""
    assert parse_settings(["--deterministic"]).engine_config("/m").deterministic is True
    assert parse_settings(["--no-deterministic"]).engine_config("/m").deterministic is False
    assert parse_settings([]).engine_config("/m").deterministic is False
