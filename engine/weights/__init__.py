"""Where weights come from and how they are laid out: `model_source` (what the engine reads),
`model_open` (the one place that decides what a path is), `hf_folder` and `gguf/` (the two kinds),
`loader` (tensors into our model classes), `cpu_weights` (the start-up choice of CPU linears)."""
