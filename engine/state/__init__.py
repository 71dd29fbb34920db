"""Per-sequence recurrent state of hybrid models (LFM2's short convolutions), beside the paged KV cache:
the slot pool the scheduler admits against (pool.py), the state tensors and the KV / state memory split
(conv_cache.py), one step's view of them that the model's conv layers read and write (batch.py), and the
state checkpoints that let a hybrid reuse a prefix across turns (checkpoints.py: which slot holds which
prefix; checkpoint_store.py: the tensors and copies)."""
