"""tokenmill's HTTP server: native SSE /generate, the OpenAI API, priority lanes, one engine worker."""
