"""What the operator sets: the one settings class (settings.py; files, environment, flags), the flags
(flags.py) and vLLM's spellings of them (vllm_flags.py), model versions as settings name them
(versions.py), the default model, and the lanes' definitions (lanes.py). Imports server.http and
server.prompt only."""
