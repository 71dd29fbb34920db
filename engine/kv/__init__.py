"""The paged KV cache: `block_manager` (ref-counted blocks, free list, prefix caching; plain Python),
`cache` (the tensors and their sizing; torch), `events` (what the prefix cache gained and lost) and
`events_zmq` (those events on the wire, as vLLM publishes them). Importing the package loads no torch."""
