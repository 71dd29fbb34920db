"""Running the model: `model_runner` (packs a step, runs the model over the paged cache, samples),
`cuda_graphs`, `draft_model` (speculative decoding's draft model), `startup` (device, dtype, threads,
block size, context length and KV size of the torch engine)."""
