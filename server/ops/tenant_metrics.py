"""Per-tenant series (server/serving/tenants.py): the tenant's name is their only label besides the reason
of a refusal, and names come from the configuration only (a bounded set; a key is never a label)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from server.ops.metrics import LATENCY_BUCKETS

# why a tenant's request was refused: its quotas (server/serving/tenants.py), or its lane was full
REASONS = ("tokens_per_minute", "requests_per_minute", "max_concurrent", "lane_full")


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry, tenants: list[str]) -> None:
        self.requests = Counter("tokenmill_tenant_requests", "Requests admitted for a tenant that ended.",
                                ["tenant"], registry=registry)  # fmt: skip
        self.prompt_tokens = Counter("tokenmill_tenant_prompt_tokens", "Prompt tokens of a tenant's ended requests.",
                                     ["tenant"], registry=registry)  # fmt: skip
        self.generation_tokens = Counter("tokenmill_tenant_generation_tokens", "Tokens generated for a tenant.",
                                         ["tenant"], registry=registry)  # fmt: skip
        self.rejections = Counter("tokenmill_tenant_rejections", "A tenant's requests refused with 429, by the "
                                  "quota or lane bound hit.", ["tenant", "reason"], registry=registry)  # fmt: skip
        self.queue_time = Histogram("tokenmill_tenant_queue_time_seconds", "Arrival until a tenant's request "
                                    "left its lane (started, or ended while queued).", ["tenant"],
                                    buckets=LATENCY_BUCKETS, registry=registry)  # fmt: skip
        for name in tenants:  # every configured tenant shows from the first scrape, at 0: rate() sees a burst
            for series in (self.requests, self.prompt_tokens, self.generation_tokens, self.queue_time):
                series.labels(tenant=name)
            for reason in REASONS:
                self.rejections.labels(tenant=name, reason=reason)

    def observe_choice(self, tenant: str, prompt_tokens: int, generated_tokens: int, queue_s: float | None,
                       first: bool) -> None:  # fmt: skip
        """One choice ended; `first`: it is its request's first choice (requests count once)."""
        if first:
            self.requests.labels(tenant=tenant).inc()
        self.prompt_tokens.labels(tenant=tenant).inc(prompt_tokens)
        self.generation_tokens.labels(tenant=tenant).inc(generated_tokens)
        if queue_s is not None:
            self.queue_time.labels(tenant=tenant).observe(queue_s)

    def observe_rejected(self, tenant: str, reason: str) -> None:
        self.rejections.labels(tenant=tenant, reason=reason).inc()
