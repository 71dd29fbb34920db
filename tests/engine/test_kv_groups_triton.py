"""Gemma 3's two KV-cache groups (engine/kv/groups.py) through the Triton attention kernels (under the
Triton interpreter): each layer reads its group's block tables and slots, the sliding group's blocks are
freed as the window passes, and greedy output equals transformers'."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or the kernels are imported: kernels take CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.kv.cache import allocate_grouped_kv_cache  # noqa: E402
from engine.models.windows import layer_groups  # noqa: E402
from engine.runner import startup  # noqa: E402

from .helpers import Case, greedy, hf_reference, make_engine, mismatches  # noqa: E402


def _triton_backend():
    pytest.importorskip("triton")
    from engine.attention import triton_kernels as K

    if not K.INTERPRETED:  # imported earlier in this process without the interpreter: decorate again
        importlib.reload(K)
    from engine.attention import triton_backend

    tiles = triton_backend.TritonTiles(decode_n=16, prefill_m=16, prefill_n=16)  # small: the interpreter is slow
    return triton_backend.TritonAttentionBackend(num_sms=4, tiles=tiles, num_splits=None)


def test_two_groups_through_the_triton_kernels_match_transformers(build_model):
    path = build_model("tiny-gemma3")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (45, 38)]
    case = Case(prompts, [10, 12])
    ref = hf_reference(path, case)
    engine = make_engine(path, block_size=16, attention_backend="torch", max_num_batched_tokens=32)
    backend = _triton_backend()
    runner = engine.runner
    spec = startup.kv_spec(engine.hf_config, engine.block_size, engine.dtype)
    runner.backend = backend
    runner.kv_caches = allocate_grouped_kv_cache(spec, engine.kv_group_blocks, layer_groups(engine.hf_config),
                                                 torch.device("cpu"), backend)  # fmt: skip
    blocks = engine.scheduler.blocks
    for i, (p, m) in enumerate(zip(case.prompts, case.max_tokens, strict=True)):
        engine.add_request(str(i), prompt_token_ids=p, params=greedy(m))
    got: dict[str, list[int]] = {}
    freed = 0
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        freed = max([freed] + [r.kv_groups[0].num_freed_blocks for r in engine.scheduler.requests.values() if r.kv_groups])
    assert freed > 0  # the sliding group's early blocks left the window (NULL_BLOCK in its tables)
    assert mismatches([got["0"], got["1"]], ref.token_ids) == []
    engine.check_integrity()
    assert blocks.num_used_blocks == 0 and blocks.others[0].num_used_blocks == 0
