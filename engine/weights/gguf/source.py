"""A GGUF file as a ModelSource: validated file, config, tokenizer, stop tokens, weights."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from engine.weights.gguf.config import architecture_of, hf_config
from engine.weights.gguf.reader import open_gguf
from engine.weights.gguf.tokenizer import eos_token_ids, load_tokenizer
from engine.weights.gguf.weights import GGUFWeights
from engine.weights.model_source import ModelSource

log = logging.getLogger("tokenmill.engine")


def open_gguf_source(path: Path, name: str | None = None) -> ModelSource:
    """Everything is checked here (file, architecture, tensor names and types, tokenizer) before the
    engine allocates anything. `name`: the served name (default: the file's stem)."""
    t0 = time.perf_counter()
    gf = open_gguf(path)
    arch = architecture_of(gf)
    config = hf_config(gf)
    weights = GGUFWeights(gf, arch, config.num_attention_heads, config.num_key_value_heads)
    tokenizer = load_tokenizer(gf)
    log.info("opened %s: %s, %d tensors (%s), %.0f MiB, in %.1fs", path.name, gf.architecture,
             len(gf.tensors), _type_summary(gf), gf.size / 2**20, time.perf_counter() - t0)
    return ModelSource(
        name=name or path.stem,
        path=path,
        format="gguf",
        hf_config=config,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(gf, tokenizer),
        weights=weights,
    )


def _type_summary(gf) -> str:
    counts: dict[str, int] = {}
    for t in gf.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
