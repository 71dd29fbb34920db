"""Model versions as the settings name them: `name@version`, the `models:` setting in every form, the
models folder's two layouts (MODELS_DIR/name/version/, never "latest"; llama.cpp's flat NAME.gguf and
NAME/ model folders), the on-demand flags with llama.cpp's spellings, and the fingerprint that versions
a bare --model."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.config import versions
from server.config.flags import parse_settings
from server.config.settings import ServerSettings
from server.config.versions import ModelEntry, ModelSpec, fingerprint, parse_entries, split_ref, startup_specs


def test_refs_and_specs():
    assert split_ref("tiny@v2") == ("tiny", "v2")
    assert split_ref("org/tiny") == ("org/tiny", None)
    assert ModelSpec("org/tiny", "2024-06.1+b", "/m").ref == "org/tiny@2024-06.1+b"
    for name, version in (("a@b", "v1"), ("", "v1"), ("tiny", ""), ("tiny", "v/1"), ("tiny", "v 1"), (" x", "v1")):
        with pytest.raises(ValueError):
            ModelSpec(name, version, "/m")


def test_models_setting_forms(tmp_path, monkeypatch):
    assert parse_entries("a@v1=/m/a, b@v2") == [{"name": "a", "version": "v1", "path": "/m/a"},
                                                {"name": "b", "version": "v2", "path": None}]  # fmt: skip
    with pytest.raises(ValueError, match="needs a version"):
        parse_entries("a=/m/a")
    s = parse_settings(["--models", "a@v1=/m/a"])
    assert s.models == [ModelEntry(name="a", version="v1", path="/m/a")]
    monkeypatch.setenv("TOKENMILL_MODELS", "b@v7=/m/b")
    assert parse_settings([]).models[0].version == "v7"
    cfg = tmp_path / "s.yaml"
    cfg.write_text("models:\n  - {name: a, version: v1, path: /m/a}\n  - {name: b, version: v3}\nmodels_dir: /m\n")
    monkeypatch.delenv("TOKENMILL_MODELS")
    s = parse_settings(["--config", str(cfg)])
    assert [(e.name, e.version, e.path) for e in s.models] == [("a", "v1", "/m/a"), ("b", "v3", None)]
    with pytest.raises(ValidationError, match="not both"):
        ServerSettings(model="/m/a", models="a@v1=/m/a")
    with pytest.raises(ValidationError, match="model_version"):
        ServerSettings(model_version="has space")
    with pytest.raises(ValidationError, match="a models entry names its own"):
        ServerSettings(models="a@v1=/m/a", served_model_name="b")
    s = ServerSettings(admin_api_keys="k1, k2", response_cache_bytes="2MiB")
    assert s.accepted_admin_keys() == ("k1", "k2") and s.response_cache_bytes == 2 << 20
    assert ServerSettings().accepted_admin_keys() == () and ServerSettings().response_cache_bytes == 0


def test_startup_specs_from_entries_and_folders(tmp_path):
    for name, version in (("alpha", "v1"), ("beta", "2")):
        (tmp_path / name / version).mkdir(parents=True)
    assert startup_specs([], None) == []
    assert startup_specs([], str(tmp_path)) == []  # the folder's models load on demand: nothing at startup
    specs = [spec for spec, _ in versions.catalog_specs([], str(tmp_path))]
    assert [(s.name, s.version, s.path) for s in specs] == [("alpha", "v1", str(tmp_path / "alpha" / "v1")),
                                                            ("beta", "2", str(tmp_path / "beta" / "2"))]  # fmt: skip
    entries = [ModelEntry(name="beta", version="2"), ModelEntry(name="x", version="v9", path="/else")]
    specs = startup_specs(entries, str(tmp_path))
    assert [s.ref for s in specs] == ["beta@2", "x@v9"] and specs[0].path == str(tmp_path / "beta" / "2")
    with pytest.raises(ValueError, match=r"models\[0\].path.*does not exist"):
        startup_specs([ModelEntry(name="beta", version="3")], str(tmp_path))
    with pytest.raises(ValueError, match=r"models\[0\].path: no path given and no models_dir"):
        startup_specs([ModelEntry(name="beta", version="3")], None)
    with pytest.raises(ValueError, match="listed twice"):
        startup_specs([ModelEntry(name="a", version="1", path="/p"), ModelEntry(name="a", version="2", path="/q")], None)
    # Two versions of one name and nothing saying which serves: refused, never "the latest".
    (tmp_path / "alpha" / "v2").mkdir()
    with pytest.raises(ValueError, match=r"'alpha' has 2 versions \['v1', 'v2'\]"):
        versions.catalog_specs([], str(tmp_path))
    # ... until a models entry says which one serves: entries first, then the folder's other names
    specs = [spec.ref for spec, _ in versions.catalog_specs([ModelEntry(name="alpha", version="v2")], str(tmp_path))]
    assert specs == ["alpha@v2", "beta@2"]
    with pytest.raises(ValueError, match="is not a folder"):
        versions.catalog_specs([], str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="holds no models"):
        versions.catalog_specs([], str(tmp_path / "alpha" / "v1"))


def test_models_folder_layouts(tmp_path):
    """llama.cpp's flat layout (NAME.gguf, NAME/ with a model in it) beside tokenmill's NAME/VERSION/: a
    flat entry is a model with one version, its content fingerprint."""
    (tmp_path / "flat.gguf").write_bytes(b"GGUF" + bytes(60))
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text("{}")
    (tmp_path / "weights-only").mkdir()
    (tmp_path / "weights-only" / "model.safetensors").write_bytes(bytes(16))
    (tmp_path / "versioned" / "v3").mkdir(parents=True)
    (tmp_path / "versioned" / "v3" / "config.json").write_text("{}")
    (tmp_path / "README.md").write_text("not a model")
    (tmp_path / ".cache").mkdir()
    found = {spec.name: (spec, aliases) for spec, aliases in versions.catalog_specs([], str(tmp_path))}
    assert sorted(found) == ["flat", "folder", "versioned", "weights-only"]
    assert found["flat"][0].version == fingerprint(tmp_path / "flat.gguf") and found["flat"][1] == {"flat.gguf"}
    assert found["flat"][0].path == str(tmp_path / "flat.gguf")
    assert found["folder"][0].version == fingerprint(tmp_path / "folder")
    assert found["folder"][0].path == str(tmp_path / "folder")
    assert found["versioned"][0].ref == "versioned@v3" and found["versioned"][0].path == str(tmp_path / "versioned" / "v3")
    (tmp_path / "folder.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"\['folder'\] each name both a NAME.gguf file and a NAME/ folder"):
        versions.catalog_specs([], str(tmp_path))


def test_on_demand_flags_with_llama_cpp_spellings(tmp_path):
    s = parse_settings(["--models-dir", str(tmp_path), "--models-max", "2", "--sleep-idle-seconds", "30"])
    assert (s.models_dir, s.models_max, s.models_idle_unload_s) == (str(tmp_path), 2, 30.0)
    s = parse_settings(["--models-idle-unload-s", "5", "--models-load-wait-s", "9"])
    assert (s.models_max, s.models_idle_unload_s, s.models_load_wait_s) == (4, 5.0, 9.0)  # llama.cpp's default max
    cfg = tmp_path / "s.yaml"
    cfg.write_text("models_dir: /m\nmodels_max: 0\nmodels_idle_unload_s: 600\n")
    s = parse_settings(["--config", str(cfg)])
    assert (s.models_dir, s.models_max, s.models_idle_unload_s) == ("/m", 0, 600.0)
    for bad in (["--models-max", "-1"], ["--sleep-idle-seconds", "0"], ["--models-load-wait-s", "0"]):
        with pytest.raises(ValidationError):
            parse_settings(bad)


def test_fingerprint_follows_the_files(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": 1}')
    weights = folder / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * 20000)  # 5 MB: hashed by its ends
    first = fingerprint(folder)
    assert first == fingerprint(folder) and len(first) == 12
    data = bytearray(weights.read_bytes())
    data[-10] ^= 1
    weights.write_bytes(bytes(data))
    second = fingerprint(folder)
    assert second != first
    (folder / "config.json").write_text('{"a": 2}')
    assert fingerprint(folder) not in (first, second)
    assert fingerprint(weights) != fingerprint(folder)  # a single-file model (GGUF) is versioned too
