"""Request accounting: every request that ended, or was refused at its lane, becomes metrics on its
version's series, one JSON line in the request log (`tokenmill.requests`) and a record feedback can find
(server/ops/feedback.py RequestRecords). Engine-answered requests are accounted on their version's
worker thread (`finished`), response-cache replays and lane refusals on the event loop.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from engine.api import Deadline
from server.ops.feedback import RequestRecord, RequestRecords
from server.ops.tenant_metrics import TenantMetrics
from server.serving.ticket import Ticket

if TYPE_CHECKING:
    from server.serving.deployment import Deployment
    from server.serving.worker import Rejection

request_log = logging.getLogger("tokenmill.requests")


class RequestAccounting:
    """Counts, logs and records ended requests. `log_prompts`: log lines carry prompt and output ids."""

    def __init__(self, records: RequestRecords, log_prompts: bool = False,
                 tenant_metrics: TenantMetrics | None = None) -> None:  # fmt: skip
        self.records = records
        self._log_prompts = log_prompts
        self.tenant_metrics = tenant_metrics

    def rejected(self, dep: Deployment, ticket: Ticket, rejection: Rejection) -> None:
        """A request its lane refused (429): counted and logged, not recorded (nothing to rate)."""
        dep.metrics.observe_rejected(ticket.lane, rejection.reason)
        request_log.info(json.dumps({
            "event": "request", "id": ticket.request_id, "model": dep.name, "version": dep.version,
            "lane": ticket.lane.label, "tenant": ticket.tenant, "status": "rejected", "reason": rejection.reason,
            "finish_reason": None,
            "prompt_tokens": len(ticket.prompt_token_ids), "retry_after_s": rejection.retry_after_s,
        }))  # fmt: skip

    def finished(self, dep: Deployment, ticket: Ticket) -> None:
        """Runs on the version's worker thread when any admitted request ends (internal ones are skipped)."""
        if ticket.internal:
            return
        status, reason = request_status(ticket)
        lengths = (len(ticket.prompt_token_ids), ticket.completion_tokens)
        dep.metrics.observe_finished(ticket.lane, status, reason, lengths, ticket.timing(), _params(ticket),
                                     ticket.params.lora_name)  # fmt: skip
        self._account(dep, ticket, status, reason, cached=False)

    def cache_hit(self, dep: Deployment, ticket: Ticket) -> None:
        """A request answered from the response cache: counted, timed, logged and recorded (for feedback)
        like any other; the engine counters do not move."""
        reason = ticket.finish_reason or "stop"
        lengths = (len(ticket.prompt_token_ids), ticket.completion_tokens)
        dep.metrics.observe_finished(ticket.lane, "ok", reason, lengths, ticket.timing(), _params(ticket),
                                     ticket.params.lora_name)  # fmt: skip
        self._account(dep, ticket, "ok", reason, cached=True)

    def _account(self, dep: Deployment, ticket: Ticket, status: str, reason: str, cached: bool) -> None:
        timing = ticket.timing()
        line: dict[str, Any] = {
            "event": "request", "id": ticket.request_id, "model": dep.name, "version": dep.version,
            "lane": ticket.lane.label, "status": status, "reason": reason, "finish_reason": ticket.finish_reason,
            "prompt_tokens": len(ticket.prompt_token_ids), "completion_tokens": ticket.completion_tokens,
            "cached_tokens": ticket.cached_tokens, **timing, "kv_blocks_peak": ticket.kv_blocks_peak,
            "response_cached": cached, "lora": ticket.params.lora_name, "tenant": ticket.tenant,
        }  # fmt: skip
        if ticket.error is not None:
            line["error"] = ticket.error.message
        if self._log_prompts:
            line["prompt_token_ids"] = ticket.prompt_token_ids
            line["output_token_ids"] = ticket.output_token_ids
        request_log.info(json.dumps(line))
        if self.tenant_metrics is not None:
            self.tenant_metrics.observe_choice(ticket.tenant, len(ticket.prompt_token_ids), ticket.completion_tokens,
                                               timing["queue_s"], ticket.record_key.choice == 0)  # fmt: skip
        key = ticket.record_key
        self.records.put(RequestRecord(
            key.request_id, dep.name, dep.version, ticket.lane.label, status, ticket.finish_reason,
            len(ticket.prompt_token_ids), ticket.completion_tokens, ticket.cached_tokens, timing["queue_s"],
            timing["ttft_s"], timing["e2e_s"], ticket.kv_blocks_peak, ticket.preemptions, cached, time.time(),
            owner=key.owner, choice=key.choice, lora=ticket.params.lora_name, tenant=ticket.tenant,
        ))  # fmt: skip


def request_status(ticket: Ticket) -> tuple[str, str]:
    """(status, reason) of an ended request, as metrics and the request log label it (server/ops/metrics.py
    REASONS lists them)."""
    if ticket.error is not None:
        kind = ticket.error.kind
        return _ERROR_STATUS.get(kind, ("error", kind if kind == "worker_died" else "engine_error"))
    reason = ticket.finish_reason or "stop"
    if reason == "timeout":
        return "timeout", "first_token" if ticket.deadline_hit is Deadline.FIRST_TOKEN else "total"
    if reason == "abort":
        return "cancelled", "client"
    if reason == "error":
        return "error", "engine_error"
    return "ok", reason


_ERROR_STATUS = {
    "queue_timeout": ("timeout", "queue"),
    "shutdown": ("cancelled", "shutdown"),
    "slow_client": ("cancelled", "slow_client"),  # stopped reading its stream (server/api/stream_guard.py)
    "invalid_request": ("rejected", "invalid_request"),
}


def _params(ticket: Ticket) -> tuple[int, int] | None:
    """(max_tokens, n) of the client request, from its first choice only (one observation per request)."""
    return (ticket.params.max_tokens, ticket.choices) if ticket.record_key.choice == 0 else None
