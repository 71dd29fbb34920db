"""GGUF files (llama.cpp's format) served directly: read with the `gguf` package (memory-mapped),
config, tokenizer and chat template from the metadata, weights dequantized at load.

- `reader.py`: open and validate a file (magic, version, truncation, tensor types)
- `config.py`: metadata -> a transformers config (llama, mistral, qwen2, qwen3)
- `tensors.py`: llama.cpp tensor names -> Hugging Face names; undoing the Q/K row permutation
- `dequant.py`: tensor data -> torch tensors (F32/F16/BF16 zero-copy, quantized types dequantized)
- `tokenizer.py`: the fast tokenizer (transformers builds it from the file) and the stop tokens
- `source.py`: all of the above as one `ModelSource` (engine/weights/model_source.py)
- `convert.py`: `tokenmill convert FILE.gguf OUT_DIR`, a Hugging Face folder
"""

from engine.weights.gguf.errors import GGUFError

__all__ = ["GGUFError"]
