"""Iteration-level scheduler: decides, each step, which tokens of which requests run. Plain Python, no torch.

Each step it (1) ends requests whose deadlines passed, then (2) walks running and waiting requests
together in the one order of engine/sched/ordering.py, spending the token budget (max_num_batched_tokens)
as it goes: a running request gets its next chunk (a decode is one token); a waiting request starts
if a seat (max_num_seqs) and KV blocks are free or can be taken from running requests it outranks.
Preemption is by recompute: the victim's blocks are freed (their prefix stays findable in the prefix
cache) and it waits again with its original arrival, so it keeps its place in line.

A hybrid model (engine/state/) also needs a free state slot to start a request; the slot is taken with
the seat and freed wherever the blocks are (finish, abort, preemption: its state is rebuilt by the
recompute from position 0, or from a checkpoint). With state checkpoints (engine/state/checkpoints.py) a
hybrid reuses a prefix only where both its KV blocks and a checkpoint of its state exist (the longest
such prefix); a prompt chunk is cut at the last block boundary of the request's tokens, so the state
there exists at a step's end and is saved.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from engine.api import Deadline, FinishReason, PreemptionCause
from engine.kv.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.sched.fair_share import FairShare
from engine.sched.ordering import PriorityPolicy
from engine.sched.outputs import ScheduledRequest, SchedulerOutput
from engine.sched.waiting_queue import WaitingQueue
from engine.spec.drafts import Proposer, SpeculativeConfig, draft_length, may_speculate, update_acceptance
from engine.spec.gate import SpecGate
from engine.spec.proposers import BatchProposer, LearningProposer, make_proposer
from engine.state.checkpoints import CheckpointIndex
from engine.state.pool import StatePool


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # most requests running at once
    max_num_batched_tokens: int  # token budget of one step
    aging_s: float = 0.0  # seconds of waiting per priority level gained (engine/sched/ordering.py); 0: off
    # A prompt chunk of a request in a step that also runs a more important request, or (fair share) of
    # a tenant holding its seat share in a step that runs a tenant under its own: at most this many
    # tokens (None: the whole budget), so that step, and the other request's next token, is not held
    # up by a long prefill (the step's time grows with its tokens).
    outranked_chunk_tokens: int | None = 256
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # Most distinct LoRA adapters among running requests (their device copies, engine/lora/registry.py);
    # a waiting request on another adapter waits for one to finish. None: LoRA off.
    max_loras: int | None = None
    # Fair share between tenants (engine/sched/fair_share.py): weights by tenant name (others: 1), and
    # whether a tenant under its seat share takes a seat from one over it in the same lane
    tenant_weights: tuple[tuple[str, float], ...] = ()
    fair_seats: bool = True


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic, state_pool: StatePool | None = None,
                 checkpoints: CheckpointIndex | None = None) -> None:  # fmt: skip
        """state_pool: a hybrid model's recurrent-state slots (engine/state/pool.py); None: none.
        checkpoints: its state checkpoints (engine/state/checkpoints.py; the block manager caches
        prefixes then); None: a hybrid reuses no prefix."""
        self.config = config
        self.blocks = block_manager
        self.state = state_pool
        self.checkpoints = checkpoints
        self.fair = FairShare(dict(config.tenant_weights), max_seats=config.max_num_seqs if config.fair_seats else None)
        self.policy = PriorityPolicy(config.aging_s, self.fair)
        self.clock = clock  # the callers' clock: arrival times and deadlines are read on it
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.preemptions_by: Counter[tuple[int, PreemptionCause]] = Counter()  # (victim priority, cause)
        self._deadlines = _DeadlineHeap()
        spec = config.speculative
        self.proposer: Proposer | None = make_proposer(spec)  # drafts tokens (a draft model's: set by the engine)
        # Whether a step's decodes carry drafts, from measured step times (engine/spec/gate.py); None:
        # whenever speculation is on (tests that count drafts)
        self.spec_gate: SpecGate | None = SpecGate() if spec is not None else None

    # ---- admission ----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.fair.arrived(request.tenant)
        request.waiting_since = request.arrival_time
        self.waiting.add(request)
        self._deadlines.add(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request (any state): free its blocks at once and forget it."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self.fair.unseated(request.tenant)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        self.blocks.free(request)
        if self.state is not None:
            self.state.free(request)
        if self.checkpoints is not None:  # a failed step may have half-written its checkpoint slot
            self.checkpoints.release(request, keep=reason is not FinishReason.ERROR)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if self.requests.pop(request.request_id, None) is not None:
            self.fair.left(request.tenant)
        self._deadlines.compact(len(self.requests))
        if isinstance(self.proposer, LearningProposer):  # suffix decoding caches what it generated
            self.proposer.finished(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput()
        for req, kind in self._deadlines.expired(now):
            self.finish(req, FinishReason.TIMEOUT)
            out.expired.append((req, kind))
        _StepPlanner(self, now, out).plan()
        return out

    def preempt(self, victim: Request, cause: PreemptionCause, now: float) -> None:
        """Free a running request's blocks and queue it again (same arrival: same place in line)."""
        self.running.remove(victim)
        self.fair.unseated(victim.tenant)
        self.blocks.free(victim)
        if self.state is not None:  # recompute: the state is rebuilt when it runs again (from position 0,
            self.state.free(victim)  # or from the longest checkpoint, maybe its own)
        if self.checkpoints is not None:
            self.checkpoints.release(victim)
        victim.status = RequestStatus.WAITING
        victim.waiting_since = now
        self.count_preemption(victim, cause)
        self.waiting.add(victim)

    def count_preemption(self, victim: Request, cause: PreemptionCause) -> None:
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by[(victim.priority, cause)] += 1

    # ---- after the model ran -------------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """Mark this step's tokens computed and register newly full blocks in the prefix cache. Draft
        tokens are not counted: `settle_drafts` adds the accepted ones once they are appended."""
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens = s.start + s.num_tokens - len(s.draft_token_ids)
            self.blocks.register_computed_blocks(req)
            self.blocks.release_out_of_window(req)
            if s.state_save is not None:
                self._register_checkpoint(req)
            # its tenant's service: prompt tokens computed for the first time, and the token sampled
            prompt = max(0, min(req.num_computed_tokens, req.num_prompt_tokens) - req.num_charged_prompt_tokens)
            req.num_charged_prompt_tokens += prompt
            self.fair.charge(req.tenant, prompt, 1 if s.sample else 0)

    def _register_checkpoint(self, req: Request) -> None:
        """The step just run copied req's state at its computed tokens (a block boundary) into its
        checkpoint slot: register it under the chained hash of the prefix's last block. A prompt's
        checkpoint is let go at once; one past the prompt stays held, so the next boundary its answer
        reaches overwrites it (engine/state/checkpoints.py)."""
        assert self.checkpoints is not None
        done = req.num_computed_tokens
        if done % self.blocks.block_size or req.num_hashed_blocks * self.blocks.block_size != done \
                or req.last_block_hash is None:  # fmt: skip
            self.checkpoints.release(req, keep=False)  # no key for it (never: saves end at a hashed block)
            return
        self.checkpoints.register(req, req.last_block_hash, tuple(req.tokens(0, done)))
        if done <= req.num_prompt_tokens:
            self.checkpoints.release(req)

    def record_step_time(self, out: SchedulerOutput, elapsed_s: float, emitted_tokens: int) -> None:
        """Feed a finished step's time to the speculation gate, when every row of it was a decode."""
        if self.spec_gate is None or not out.scheduled:
            return
        if all(s.sample and s.num_tokens == 1 + len(s.draft_token_ids) for s in out.scheduled):
            speculated = any(s.draft_token_ids for s in out.scheduled)
            self.spec_gate.record(len(out.scheduled), speculated, elapsed_s, emitted_tokens)

    def settle_drafts(self, s: ScheduledRequest, accepted: int) -> None:
        """After a verified row's tokens were appended: its first `accepted` drafts' K/V are valid, the
        rest are rolled back (the block table shrinks to the computed tokens), full blocks are registered
        and the request's acceptance rate (its next draft length) is updated."""
        req = s.request
        req.num_computed_tokens += accepted
        self.fair.charge(req.tenant, 0, accepted)
        self.blocks.truncate(req)
        self.blocks.register_computed_blocks(req)
        self.blocks.release_out_of_window(req)
        update_acceptance(req, len(s.draft_token_ids), accepted)


class _StepPlanner:
    """One step's decisions (see the module docstring). Lives for one schedule() call."""

    def __init__(self, sched: Scheduler, now: float, out: SchedulerOutput) -> None:
        self.s = sched
        self.policy = sched.policy
        self.now = now
        self.out = out
        self.budget = sched.config.max_num_batched_tokens
        self.preempted_now: set[str] = set()  # preempted in this step: not started again in it
        self._head: Request | None = None  # the waiting queue's head as of _head_version
        self._head_version: tuple[int, int] | None = None
        self.best: int | None = None  # the most important effective priority scheduled so far this step
        # a request of a tenant under its seat share (while another tenant is active) is in this step: the
        # prompt chunks of tenants holding their share are capped like outranked ones (`_chunk`)
        self.under_share_in_step = False
        # Whether decodes may carry drafts in this step: not in a large batch (disable_by_batch_size)
        spec = sched.config.speculative
        cap = spec.disable_by_batch_size if spec is not None else None
        self.speculate = spec is not None and (cap is None or len(sched.running) <= cap)
        if self.speculate and sched.spec_gate is not None:  # and measured to pay at this batch size
            self.speculate = sched.spec_gate.should_speculate(len(sched.running))
        # Only the most important level present (running or waiting) speculates: drafts of an outranked
        # row would lengthen the step of a more important request in it, or take budget it needs.
        self.spec_level = self._top_level() if self.speculate else None
        # A batched proposer drafts for every row that may speculate, before the walk (id(req) -> drafts)
        self.prefetched: dict[int, list[int]] | None = None
        if self.speculate and isinstance(sched.proposer, BatchProposer):
            items = [(r, k) for r in sched.running if (k := min(self._draft_cap(r), self.budget - 1)) > 0]
            drafts = sched.proposer.propose_all(items) if items else []
            self.prefetched = {id(r): d for (r, _), d in zip(items, drafts, strict=True)}

    def plan(self) -> None:
        running = sorted(self.s.running, key=self._key)
        i, waiting_blocked = 0, False
        while self.budget > 0:
            while i < len(running) and running[i].status != RequestStatus.RUNNING:
                i += 1  # preempted earlier in this step
            r = running[i] if i < len(running) else None
            w = None if waiting_blocked else self._waiting_head()
            if r is None and w is None:
                break
            if w is not None and (r is None or self._key(w) < self._key(r)):
                waiting_blocked = not self._start(w)  # strict order: nobody may jump a blocked head
            else:
                i += 1
                self._continue(r)
        self._count_budget_deferrals()

    def _waiting_head(self) -> Request | None:
        """waiting.peek(), again only once the queue or the seats changed: the walk asks after every
        running request it continues, and a peek costs O(priorities x tenants)."""
        version = (self.s.waiting.changes, self.s.fair.changes)
        if version != self._head_version:
            self._head, self._head_version = self.s.waiting.peek(self.now), version
        return self._head

    def _key(self, req: Request) -> tuple[int, bool, float, float, str]:
        return self.policy.key(req, self.now)

    def _top_level(self) -> int | None:
        """The most important effective priority among running requests and the waiting head (the
        waiting queue's best key, so its best level); None when there are none."""
        levels = [self.policy.effective_priority(r, self.now) for r in self.s.running]
        head = self.s.waiting.peek(self.now)
        if head is not None:
            levels.append(self.policy.effective_priority(head, self.now))
        return min(levels, default=None)

    # -- running requests ---------------------------------------------------------------------------
    def _continue(self, req: Request) -> None:
        """Schedule req's next chunk (a decode may carry draft tokens), preempting the least important
        running requests (maybe req itself) while KV blocks are short; drafts are dropped first."""
        n = self._checkpoint_cut(req, req.num_computed_tokens, self._chunk(req, req.num_tokens - req.num_computed_tokens))
        drafts = self._drafts(req, n)
        while not self.s.blocks.allocate(req, n + len(drafts)):
            if drafts:
                drafts = []
                continue
            victim = max(self.s.running, key=lambda r: self.policy.victim_key(r, self.now))
            self._preempt(victim, PreemptionCause.KV)
            if victim is req:
                return
        self._schedule(req, n, drafts)

    def _drafts(self, req: Request, n: int) -> list[int]:
        """Draft tokens for req's decode (n == 1) when it speculates in this step: only at the step's most
        important level (`spec_level`), within the budget left and the tokens it may still emit (max_tokens)."""
        k = min(self._draft_cap(req), self.budget - 1) if n == 1 else 0
        if k <= 0:
            return []
        if self.prefetched is not None:
            return self.prefetched.get(id(req), [])[:k]
        return self.s.proposer.propose(req, k)

    def _draft_cap(self, req: Request) -> int:
        """How many drafts req's decode may carry in this step, the budget aside: 0 unless it is at one
        known token, speculates (this step, its lane, its params), its draft length and max_tokens."""
        spec = self.s.config.speculative
        if spec is None or self.s.proposer is None or not self.speculate or req.status != RequestStatus.RUNNING:
            return 0
        if req.num_tokens - req.num_computed_tokens != 1 or not may_speculate(req):
            return 0
        if self.policy.effective_priority(req, self.now) != self.spec_level:
            return 0
        return min(draft_length(req, spec.num_speculative_tokens), req.params.max_tokens - req.num_output_tokens - 1)

    # -- waiting requests ---------------------------------------------------------------------------
    def _start(self, req: Request) -> bool:
        """Start req (a seat, its cached prefix, blocks for its first chunk), taking them from running
        requests it outranks when needed. False when it cannot start in this step."""
        if req.request_id in self.preempted_now:
            return False
        if len(self.s.running) >= self.s.config.max_num_seqs and not self._preempt_for(req, PreemptionCause.SLOTS):
            return False
        if not self._adapter_fits(req):
            return False
        state = self.s.state  # a hybrid model: a state slot too (max_num_seqs <= slots makes this rare)
        while state is not None and not state.has_free():
            if not self._preempt_for(req, PreemptionCause.SLOTS):
                return False
        cached, resume = self._cached_prefix(req)
        start = len(cached) * self.s.blocks.block_size
        n = self._checkpoint_cut(req, start, self._chunk(req, req.num_tokens - start))
        while not self._fits(req, cached, n):
            if not self._preempt_for(req, PreemptionCause.KV):
                return False
        self.s.waiting.remove(req)
        req.waited_s += max(0.0, self.now - req.waiting_since)
        self.s.blocks.acquire_cached_prefix(req, cached)
        # a prefix served from the cache is not service: its tenant is charged for what is computed
        req.num_charged_prompt_tokens = max(req.num_charged_prompt_tokens,
                                            min(req.num_computed_tokens, req.num_prompt_tokens))
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
        if not self.s.blocks.allocate(req, n):
            raise RuntimeError("block allocation failed after _fits said yes")
        if state is not None:
            state.take(req)
        if resume is not None and self.s.checkpoints is not None:
            self.s.checkpoints.count_hit(start)
        req.status = RequestStatus.RUNNING
        self.s.running.append(req)
        self.s.fair.seated(req.tenant)
        if not req.started:
            req.started = True
            self.out.started.append(req)
        self._schedule(req, n, load=resume)
        return True

    def _cached_prefix(self, req: Request) -> tuple[list[int], int | None]:
        """The cached prefix blocks req starts from, and (a hybrid model) the checkpoint slot of its state
        there: the longest prefix whose KV blocks and state checkpoint both exist (None: no checkpoint).
        A request that wants prompt log-probabilities runs its whole prompt: cached blocks have no logits."""
        if req.needs_prompt_logprobs:
            return [], None
        checkpoints = self.s.checkpoints
        if checkpoints is None:  # (a hybrid without checkpoints: the block manager caches no prefix)
            return self.s.blocks.find_cached_prefix(req), None
        ids, hashes = self.s.blocks.find_cached_chain(req)
        k, slot = checkpoints.longest(req, hashes)
        return ids[:k], slot

    def _checkpoint_cut(self, req: Request, start: int, n: int) -> int:
        """n, or fewer so that a chunk from `start` ends at req's checkpoint position (the last block
        boundary of its tokens) instead of running past it: the state there then exists at a step's end."""
        if self.s.checkpoints is None or n <= 1:
            return n
        at = req.num_tokens // self.s.blocks.block_size * self.s.blocks.block_size
        return at - start if start < at < start + n else n

    def _adapter_fits(self, req: Request) -> bool:
        """Whether req's adapter is running already or a step may hold one more (max_loras)."""
        limit = self.s.config.max_loras
        if limit is None or req.lora_id == 0:
            return True
        running = {r.lora_id for r in self.s.running if r.lora_id}
        return req.lora_id in running or len(running) < limit

    def _fits(self, req: Request, cached: list[int], n: int) -> bool:
        """Whether req can take its cached prefix blocks plus blocks for n new tokens (in every KV group)."""
        return self.s.blocks.fits(req, cached, n)

    def _preempt_for(self, req: Request, cause: PreemptionCause) -> bool:
        """Preempt the least important running request if req outranks it."""
        if not self.s.running:
            return False
        victim = max(self.s.running, key=lambda r: self.policy.victim_key(r, self.now))
        if not self.policy.outranks(req, victim, self.now):
            return False
        self._preempt(victim, cause)
        return True

    # -- bookkeeping --------------------------------------------------------------------------------
    def _chunk(self, req: Request, left: int) -> int:
        """How many of req's `left` tokens run this step: what the budget allows, and
        `outranked_chunk_tokens` for a prompt chunk of a request that a request already in this step
        outranks, or of a tenant holding its seat share in a step that runs a tenant under its own (so
        the step that seats a small tenant's request is not a whole budget of a big tenant's prefill)."""
        n = min(left, self.budget)
        cap = self.s.config.outranked_chunk_tokens
        if n <= 1 or cap is None:
            return n
        if self.best is not None and self.best < self.policy.effective_priority(req, self.now):
            return min(n, cap)
        if self.under_share_in_step and self.s.fair.at_share(req.tenant):
            return min(n, cap)
        return n

    def _schedule(self, req: Request, n: int, drafts: list[int] | None = None, load: int | None = None) -> None:
        """Add req's next n tokens (and drafts) to the step; load: the checkpoint slot it resumes from."""
        start = req.num_computed_tokens
        ends = start + n == req.num_tokens
        drafts = drafts or []
        # max_tokens 0 (prompt log-probabilities only): the prompt runs, nothing is sampled
        sample = ends and req.params.max_tokens > 0
        self.out.scheduled.append(ScheduledRequest(req, start, n + len(drafts), sample, drafts, load,
                                                   self._checkpoint_save(req, start + n)))
        self.budget -= n + len(drafts)
        req.budget_deferred = False
        eff = self.policy.effective_priority(req, self.now)
        self.best = eff if self.best is None else min(self.best, eff)
        self.under_share_in_step = self.under_share_in_step or self.s.fair.under_share(req.tenant)

    def _checkpoint_save(self, req: Request, end: int) -> int | None:
        """The checkpoint slot req's state is saved into after a chunk ending at `end`, when that is its
        checkpoint position (the last block boundary of its tokens); None: no save (or no slot free)."""
        checkpoints, bs = self.s.checkpoints, self.s.blocks.block_size
        if checkpoints is None or end == 0 or end != req.num_tokens // bs * bs:
            return None
        return checkpoints.take(req)

    def _preempt(self, victim: Request, cause: PreemptionCause) -> None:
        """Preempt victim; the tokens it was given in this step go back into the budget."""
        kept = []
        for s in self.out.scheduled:
            if s.request is victim:
                self.budget += s.num_tokens
            else:
                kept.append(s)
        self.out.scheduled = kept
        if any(r is victim for r in self.out.started):  # it never ran: it has not started after all
            self.out.started = [r for r in self.out.started if r is not victim]
            victim.started = False
        self.s.preempt(victim, cause, self.now)
        self.preempted_now.add(victim.request_id)

    def _count_budget_deferrals(self) -> None:
        """A running request left out of this step while a request that outranks it ran lost its turn
        to priority: a budget preemption (counted once until it is scheduled again)."""
        if not self.out.scheduled:
            return
        best = min(self.policy.effective_priority(s.request, self.now) for s in self.out.scheduled)
        scheduled = {id(s.request) for s in self.out.scheduled}
        for req in self.s.running:
            if id(req) in scheduled or req.budget_deferred:
                continue
            if best < self.policy.effective_priority(req, self.now):
                req.budget_deferred = True
                self.s.count_preemption(req, PreemptionCause.BUDGET)


class _DeadlineHeap:
    """Every request's deadlines as absolute clock times, earliest first; finished requests' entries are
    dropped lazily (when they surface, or in a compaction once they outnumber the live requests)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Deadline, Request]] = []
        self._seq = 0  # tie-break, so Requests are never compared

    def add(self, req: Request) -> None:
        d = req.deadlines
        for kind, seconds in ((Deadline.QUEUE, d.queue_s), (Deadline.FIRST_TOKEN, d.first_token_s),
                              (Deadline.TOTAL, d.total_s)):  # fmt: skip
            if seconds is not None:
                self._seq += 1
                heapq.heappush(self._heap, (req.arrival_time + seconds, self._seq, kind, req))

    def expired(self, now: float) -> list[tuple[Request, Deadline]]:
        """Requests whose deadline has passed and still applies, each once."""
        out: list[tuple[Request, Deadline]] = []
        while self._heap and self._heap[0][0] <= now:
            _, _, kind, req = heapq.heappop(self._heap)
            if req.status != RequestStatus.FINISHED and _applies(req, kind) and all(r is not req for r, _ in out):
                out.append((req, kind))
        return out

    def compact(self, live: int) -> None:
        if len(self._heap) > 2 * live + 64:
            self._heap = [e for e in self._heap if e[3].status != RequestStatus.FINISHED]
            heapq.heapify(self._heap)


def _applies(req: Request, kind: Deadline) -> bool:
    if kind is Deadline.QUEUE:
        return not req.started
    if kind is Deadline.FIRST_TOKEN:
        return req.num_output_tokens == 0
    return True
