"""Model versions as the settings name them: `ModelSpec` (`name@version` and where its weights are), the
`models:` entries of the settings, the models folder (`models_dir`) and its two layouts, and the content
fingerprint that versions a bare `--model PATH`. Plain Python: nothing here loads a model.

A models folder holds, per name, either llama.cpp's flat layout (`DIR/NAME.gguf`, or `DIR/NAME/` a model
folder: config.json or weight files in it) or tokenmill's versions layout (`DIR/NAME/VERSION/`). A flat
entry is a model with one version, its content fingerprint (as a bare `--model PATH`).

Every served model has an explicit version. Nothing is picked as "latest": a name with two version
folders is an error until `models:` says which one serves.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

# A name may hold slashes ("org/model", as Hugging Face names do), never "@" (it separates the version).
NAME_RE = re.compile(r"^[A-Za-z0-9][\w.\-/:]{0,127}$")
VERSION_RE = re.compile(r"^[A-Za-z0-9][\w.\-+]{0,63}$")
_FINGERPRINT_EDGE = 1 << 20  # bytes read from each end of a weights file (hashing GBs would take minutes)
_SMALL_FILE = 1 << 20  # files up to this size are hashed whole (configs, tokenizer)
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")  # files that make a folder a model folder


@dataclass(frozen=True)
class ModelSpec:
    """One version of one model, before or after it is loaded."""

    name: str  # what clients send as `model` (and what /v1/models lists)
    version: str  # explicit; `model: "name@version"` pins a request to it
    path: str  # the model folder (or file) the engine loads

    def __post_init__(self) -> None:
        check_name(self.name, "name")
        check_version(self.version, "version")
        if not self.path:
            raise ValueError("path must not be empty")

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


class ModelEntry(BaseModel):
    """One `models:` entry of the settings: `{name, version, path}`; `path` defaults to
    `models_dir/name/version`."""

    model_config = ConfigDict(extra="forbid")

    name: str
    version: str
    path: str | None = None


def check_name(name: str, field: str = "name") -> None:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"{field} must be 1-128 letters, digits or ._-/: (no @), starting with a letter or digit, got {name!r}")


def check_version(version: str, field: str = "version") -> None:
    if not isinstance(version, str) or not VERSION_RE.match(version):
        raise ValueError(f"{field} must be 1-64 letters, digits or ._-+, starting with a letter or digit, got {version!r}")


def split_ref(ref: str) -> tuple[str, str | None]:
    """`"name@version"` -> (name, version); `"name"` -> (name, None)."""
    name, at, version = ref.rpartition("@")
    return (name, version) if at else (ref, None)


def parse_entries(value: Any) -> Any:
    """The `models` setting from a flag or variable: `name@version=path,name2@version2` (path optional);
    lists (YAML) pass through for pydantic to check."""
    if not isinstance(value, str):
        return value
    entries = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        ref, _, path = item.partition("=")
        name, version = split_ref(ref.strip())
        if version is None:
            raise ValueError(f"models: {item!r} needs a version (name@version[=path])")
        entries.append({"name": name, "version": version, "path": path.strip() or None})
    return entries


def startup_specs(entries: list[ModelEntry], models_dir: str | None) -> list[ModelSpec]:
    """The versions to load at startup: the `models` entries, one per name, in order (the first is the
    default model; `models_dir` resolves their paths). Empty without entries: then `--model` (or the demo
    model) serves, or the models folder's models load on demand (`catalog_specs`). Raises ValueError
    naming the setting at fault."""
    return _specs_from_entries(entries, models_dir) if entries else []


def catalog_specs(entries: list[ModelEntry], models_dir: str) -> list[tuple[ModelSpec, set[str]]]:
    """Every model a models folder serves by name, loaded on demand, each with the other names clients
    may use for it (`NAME.gguf`): the `models` entries first (they say which version of a name serves),
    then the folder's other names, sorted. Raises ValueError naming the setting or folder at fault."""
    specs = [(spec, set[str]()) for spec in _specs_from_entries(entries, models_dir)]
    named = {spec.name for spec, _ in specs}
    return specs + scan_models_dir(Path(models_dir), skip=named)


def _specs_from_entries(entries: list[ModelEntry], models_dir: str | None) -> list[ModelSpec]:
    specs: list[ModelSpec] = []
    for i, entry in enumerate(entries):
        if any(s.name == entry.name for s in specs):
            raise ValueError(f"models[{i}]: {entry.name!r} is listed twice; start with one version per name and "
                             "load more with the admin API")  # fmt: skip
        path = entry.path or version_folder(models_dir, entry.name, entry.version, f"models[{i}].path")
        try:
            specs.append(ModelSpec(entry.name, entry.version, path))
        except ValueError as exc:
            raise ValueError(f"models[{i}]: {exc}") from None
    return specs


def scan_models_dir(root: Path, skip: set[str] | None = None) -> list[tuple[ModelSpec, set[str]]]:
    """The models in a folder, sorted by name, with their aliases; both layouts (module docstring).
    Hidden entries, files other than .gguf and the names in `skip` (a `models` entry names their version)
    are left out. Raises ValueError naming the entry at fault."""
    if not root.is_dir():
        raise ValueError(f"models_dir: {str(root)!r} is not a folder")
    found: list[tuple[ModelSpec, set[str]]] = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".") or (entry.is_file() and entry.suffix != ".gguf"):
            continue
        if (entry.stem if entry.is_file() else entry.name) in (skip or set()):
            continue
        try:
            if entry.is_file():  # llama.cpp's single-file model: DIR/NAME.gguf
                found.append((ModelSpec(entry.stem, fingerprint(entry), str(entry)), {entry.name}))
            elif is_model_folder(entry):  # llama.cpp's (and Hugging Face's) model folder: DIR/NAME/
                found.append((ModelSpec(entry.name, fingerprint(entry), str(entry)), set()))
            else:  # tokenmill's versions layout: DIR/NAME/VERSION/
                version = _one_version(entry)
                found.append((ModelSpec(entry.name, version, str(entry / version)), set()))
        except ValueError as exc:
            raise ValueError(f"models_dir: {entry.name!r} {exc}") from None
    names = [spec.name for spec, _ in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"models_dir: {twice} each name both a NAME.gguf file and a NAME/ folder; keep one")
    if not found and not skip:
        raise ValueError(f"models_dir: {str(root)!r} holds no models (NAME.gguf, NAME/ model folders or "
                         "NAME/VERSION/ folders)")  # fmt: skip
    return found


def is_model_folder(folder: Path) -> bool:
    """A folder that holds a model itself (config.json or weight files), not version folders."""
    return (folder / "config.json").exists() or any(
        f.suffix in _WEIGHT_SUFFIXES and f.is_file() for f in folder.iterdir()
    )


def _one_version(name_dir: Path) -> str:
    versions = sorted(p.name for p in name_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(versions) != 1:
        raise ValueError(f"has {len(versions)} versions {versions}; say which one serves with "
                         f"`models: [{{name: {name_dir.name}, version: ...}}]`")  # fmt: skip
    return versions[0]


def version_folder(models_dir: str | None, name: str, version: str, field: str) -> str:
    """`models_dir/name/version`, which must exist. Raises ValueError naming `field`."""
    if not models_dir:
        raise ValueError(f"{field}: no path given and no models_dir set")
    check_name(name)
    check_version(version)
    folder = Path(models_dir) / name / version
    if not folder.exists():
        raise ValueError(f"{field}: {str(folder)!r} does not exist")
    return str(folder)


def fingerprint(path: str | Path) -> str:
    """A version for an unversioned `--model PATH`: 12 hex digits of sha256 over the file names and sizes,
    small files whole and the first and last MiB of large ones. Changed weights give another version."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.relative_to(root) if f != root else f.name}\0{size}\0".encode())
        with f.open("rb") as handle:
            if size <= _SMALL_FILE:
                digest.update(handle.read())
            else:
                digest.update(handle.read(_FINGERPRINT_EDGE))
                handle.seek(size - _FINGERPRINT_EDGE)
                digest.update(handle.read(_FINGERPRINT_EDGE))
    return digest.hexdigest()[:12]
