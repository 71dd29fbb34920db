"""Scheduling, plain Python: `ordering` (who runs next: effective priority, aging), `waiting_queue`,
`scheduler` (each step's tokens, budget, preemption, deadlines) and `outputs` (what a step runs, what
the runner returns, and the runner's contract)."""
