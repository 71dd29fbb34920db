"""Opening a model path: the one place that decides what it is. A path is either a Hugging Face
folder (config.json + safetensors, engine/weights/hf_folder.py) or a GGUF file, given directly or as a folder
holding exactly one `.gguf` (engine/weights/gguf/source.py); both give an engine/weights/model_source.py ModelSource.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from engine.weights.gguf.source import open_gguf_source
from engine.weights.hf_folder import open_hf_folder
from engine.weights.model_source import ModelSource


def open_model_source(path: str | os.PathLike) -> ModelSource:
    """Open a model path: a .gguf file, a folder with config.json + safetensors, or a folder holding
    one .gguf. Raises ValueError (GGUFError for GGUF problems) naming the path and the problem;
    nothing is allocated for the model before every check has passed."""
    p = Path(path)
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"model: {str(path)!r} is a file but not a .gguf file; give a .gguf file or "
                             "a Hugging Face folder (config.json + safetensors)")  # fmt: skip
        return _gguf(p)
    if not p.is_dir():
        raise ValueError(f"model: {str(path)!r} does not exist")
    gguf = _single_gguf(p)
    if (p / "config.json").is_file() and (gguf is None or any(p.glob("*.safetensors"))):
        return open_hf_folder(p)
    if gguf is not None:
        return _gguf(gguf, name=p.name)
    raise ValueError(f"model: {str(path)!r} is not a model folder (no config.json, no .gguf file)")


def with_tokenizer(source: ModelSource, path: str | os.PathLike) -> ModelSource:
    """`source` with the tokenizer of the Hugging Face folder `path` (vLLM's --tokenizer); its EOS token
    joins the model's stop tokens. Raises ValueError naming the path."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer: cannot load {str(path)!r}: {exc}") from None
    eos = set(source.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    return dataclasses.replace(source, tokenizer=tokenizer, eos_token_ids=frozenset(eos))


def _single_gguf(folder: Path) -> Path | None:
    found = sorted(folder.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise ValueError(f"model: {str(folder)!r} holds {len(found)} .gguf files ({names}); give the file")
    return found[0] if found else None


def _gguf(path: Path, name: str | None = None) -> ModelSource:
    return open_gguf_source(path, name=name)
