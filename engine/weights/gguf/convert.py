"""`tokenmill convert FILE.gguf OUT_DIR`: a GGUF file as a Hugging Face folder that transformers (and
tokenmill) load: config.json, generation_config.json, model.safetensors (dequantized, Q/K rows
unpermuted, HF names), tokenizer.json + tokenizer_config.json (chat template included) +
special_tokens_map.json, and chat_template.jinja.

Quantized tensors are written in float32 by default, the exact dequantized values; `--dtype bfloat16`
halves the folder at the cost of rounding them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.weights.gguf.errors import GGUFError
from engine.weights.gguf.source import open_gguf_source
from engine.weights.model_source import ModelSource

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert(gguf_path: str | Path, out_dir: str | Path, dtype: str = "auto") -> Path:
    """Write the folder; returns it. `dtype` auto: the file's own float type (float32 when quantized).
    Raises GGUFError for a bad file, FileExistsError when out_dir is a non-empty folder."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    source = open_gguf_source(Path(gguf_path), name=out.name)
    own = source.hf_config.dtype  # a torch.dtype, or its name (transformers versions differ)
    target = DTYPES[dtype] or (own if isinstance(own, torch.dtype) else getattr(torch, str(own)))
    out.mkdir(parents=True, exist_ok=True)
    _write_config(source, out, target)
    _write_tokenizer(source, out)
    tensors = {name: t.to(target).contiguous() for name, t in source.weights}
    if source.hf_config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # like the other files (safetensors writes it 0600)
    return out


def _write_config(source: ModelSource, out: Path, dtype: torch.dtype) -> None:
    from transformers import GenerationConfig

    config = source.hf_config
    config.dtype = dtype
    config.save_pretrained(str(out))
    # older transformers read rope_theta and torch_dtype at the top level; 5.x writes rope_parameters
    data = json.loads((out / "config.json").read_text())
    rope = data.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type (its local base: rope_local_base_freq)
    data["rope_theta"] = rope.get("rope_theta", data.get("rope_theta"))
    if "sliding_attention" in (data.get("rope_parameters") or {}):
        data["rope_local_base_freq"] = data["rope_parameters"]["sliding_attention"]["rope_theta"]
    data["torch_dtype"] = data["dtype"] = str(dtype).removeprefix("torch.")
    # GGUF stores eps as float32 (1e-6 reads back as 9.99999997e-07); 7 digits give the same float32
    data["rms_norm_eps"] = float(f"{data['rms_norm_eps']:.7g}")
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    eos = sorted(source.eos_token_ids)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else eos,
                     pad_token_id=config.pad_token_id, do_sample=False).save_pretrained(str(out))  # fmt: skip


def _write_tokenizer(source: ModelSource, out: Path) -> None:
    tok = source.tokenizer
    tok.save_pretrained(str(out))
    path = out / "tokenizer_config.json"
    data = json.loads(path.read_text())
    # transformers 5 writes "TokenizersBackend", which 4.x cannot load; this class loads in both
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    data["model_max_length"] = source.hf_config.max_position_embeddings
    if tok.chat_template:  # 5.x moves it to chat_template.jinja; 4.x reads it here
        data["chat_template"] = tok.chat_template
        (out / "chat_template.jinja").write_text(tok.chat_template)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill convert", description=__doc__.split("\n")[0])
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out_dir", type=Path, help="the folder to write (must not exist, or be empty)")
    parser.add_argument("--dtype", default="auto", choices=list(DTYPES), help="weights dtype (default: auto)")
    args = parser.parse_args(argv)
    try:
        out = convert(args.gguf, args.out_dir, args.dtype)
    except (GGUFError, FileExistsError, ValueError, OSError) as exc:
        print(f"tokenmill convert: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
