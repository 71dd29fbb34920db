"""The engine's loop, plain Python: `step_loop` (`StepLoop`: requests in, schedule, run, update,
outputs out), `output_processor` (a step's results as RequestOutputs), and the CPU threads a step runs
at (`thread_count` sets them per thread, `thread_governor` chooses them from measured step times)."""
