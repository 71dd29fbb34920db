"""What the benchmarks share, importing no benchmark: the HTTP load client (client, load_requests,
streams), the server launcher and its readiness wait (server), statistics (stats), workloads and the
default model (workloads, spec_prompts, closed_loop, adapters), machine facts (machine) and Prometheus
scrapes (prom)."""
