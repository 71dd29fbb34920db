"""Speculative decoding's proposers and gate, plain Python: `drafts` (which requests speculate, the
adaptive draft length, the n-gram proposer), `suffix_tree` (suffix decoding), `proposers` (the one a
config asks for), `gate` (when speculation pays, measured). Verifying drafts is sampling's job
(engine/sample/verify.py); the draft model needs the model loaded (engine/runner/draft_model.py)."""
