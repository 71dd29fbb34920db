"""Iteration-level scheduler: decides, each step, which tokens of which requests run.

Plain Python, no torch. Each step spends a token budget (max_num_batched_tokens) on running
requests first (decodes and unfinished prompt chunks), then on waiting requests in
(priority, arrival) order. When KV blocks run out, the least important, most recent running
request is preempted (its blocks freed; it is recomputed later, keeping its place in line).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.outputs import FinishReason
from engine.request import Request, RequestStatus
from engine.request_queue import RequestQueue


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # first token position computed this step (== num_computed_tokens before the step)
    num_tokens: int  # tokens computed this step (1 for a decode)
    sample: bool  # whether this step ends the request's known tokens, so a new token is sampled


@dataclass
class SchedulerOutput:
    """What the model runner runs this step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting = RequestQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- admission ----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request (any state): free its blocks at once and forget it."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request.request_id)
        self.blocks.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.requests.pop(request.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Running requests, most important first; victims are taken from the end of this order.
        self.running.sort(key=Request.sort_key)
        scheduled_ids: set[str] = set()
        for req in list(self.running):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            ok, refund = self._allocate_or_preempt(req, n, out, scheduled_ids)
            budget += refund
            if not ok:
                continue  # req itself was preempted
            budget -= n
            out.scheduled.append(self._scheduled(req, n))
            scheduled_ids.add(req.request_id)
        budget = self._schedule_waiting(out, budget, scheduled_ids)
        return out

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, scheduled_ids: set[str]) -> int:
        while budget > 0 and len(self.waiting):
            req = self.waiting.peek()
            assert req is not None
            if len(self.running) >= self.config.max_num_seqs:
                refund = self._preempt_for(req, out, scheduled_ids)
                if refund is None:
                    break
                budget += refund
            cached = self.blocks.find_cached_prefix(req)
            n = min(req.num_tokens - len(cached) * self.blocks.block_size, budget)
            while not self._fits(req, cached, n):
                refund = self._preempt_for(req, out, scheduled_ids)
                if refund is None:
                    return budget  # strict order: nobody behind req may jump it
                budget += refund
            self.waiting.pop()
            self.blocks.acquire_cached_prefix(req, cached)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
            ok = self.blocks.allocate(req, n)
            assert ok, "allocation checked above"
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            budget -= n
            out.scheduled.append(self._scheduled(req, n))
            scheduled_ids.add(req.request_id)
        return budget

    def _fits(self, req: Request, cached: list[int], n: int) -> bool:
        """Whether req can take its cached prefix blocks plus blocks for n new tokens."""
        bs = self.blocks.block_size
        new_blocks = -(-(len(cached) * bs + n) // bs) - len(cached)
        # Cached prefix blocks that sit in the free list stop being free once acquired.
        cached_free = sum(1 for b in cached if self.blocks.blocks[b].ref_count == 0)
        return new_blocks + cached_free <= self.blocks.num_free_blocks

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(req, start, n, sample=start + n == req.num_tokens)

    def _allocate_or_preempt(
        self, req: Request, n: int, out: SchedulerOutput, scheduled_ids: set[str]
    ) -> tuple[bool, int]:
        """Make room for n tokens of a running request, preempting the worst running requests
        (possibly req itself). Returns (req got its blocks, budget refunded by victims)."""
        refund = 0
        while not self.blocks.allocate(req, n):
            victim = self.running[-1]
            refund += self._preempt(victim, out, scheduled_ids)
            if victim is req:
                return False, refund
        return True, refund

    def _preempt_for(self, req: Request, out: SchedulerOutput, scheduled_ids: set[str]) -> int | None:
        """Preempt the worst running request if it is strictly less important than waiting req.
        Returns the budget it gives back, or None when nobody may be preempted."""
        if not self.running:
            return None
        victim = max(self.running, key=Request.sort_key)
        if victim.priority <= req.priority:
            return None
        return self._preempt(victim, out, scheduled_ids)

    def _preempt(self, victim: Request, out: SchedulerOutput, scheduled_ids: set[str]) -> int:
        """Free a running request's blocks and put it back in line. Returns its tokens scheduled
        this step (now unscheduled)."""
        refund = 0
        if victim.request_id in scheduled_ids:
            refund = sum(s.num_tokens for s in out.scheduled if s.request is victim)
            out.scheduled = [s for s in out.scheduled if s.request is not victim]
            scheduled_ids.discard(victim.request_id)
        self.running.remove(victim)
        self.blocks.free(victim)
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(victim)  # same sort key: it keeps its place in line
        return refund

    # ---- after the model ran -------------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """Mark this step's tokens computed and register newly full blocks in the prefix cache."""
        for s in out.scheduled:
            s.request.num_computed_tokens = s.start + s.num_tokens
            self.blocks.register_computed_blocks(s.request)
