"""From logits to tokens: `sampler` (batched sampling with per-request parameters), `verify` (draft
tokens checked against the target, with `draft_positions`), `prompt_logprobs`."""
