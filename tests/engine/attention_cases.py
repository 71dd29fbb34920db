"""Random attention steps and a float64 answer, shared by the kernel tests (Triton and CPU)."""

from __future__ import annotations

import torch

from engine.attention import BatchLayout


def make_layout(specs, block_size: int, num_blocks: int, gen: torch.Generator, skip=()) -> BatchLayout:
    """specs: (context_len, query_len) per sequence, decodes (query_len 1) first. Each sequence's
    blocks come from a shuffled pool; `skip` indexes new tokens whose slot becomes -1."""
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for ctx, q in specs:
        n = -(-ctx // block_size)
        table, pool = pool[:n], pool[n:]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - q, ctx)]
    for i in skip:
        slots[i] = -1
    nd = next((i for i, (_, q) in enumerate(specs) if q != 1), len(specs))
    return BatchLayout(nd, [q for _, q in specs], [c for c, _ in specs], tables, block_size, torch.tensor(slots))


def random_step(specs, heads, kv_heads, head_dim, block_size, dtype, seed, skip=()):
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-c // block_size) for c, _ in specs)
    num_blocks = need + 5  # a few blocks no sequence owns
    layout = make_layout(specs, block_size, num_blocks, gen, skip)
    t = len(layout.slot_mapping)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    step = dict(
        q=rnd(t, heads, head_dim), k=rnd(t, kv_heads, head_dim), v=rnd(t, kv_heads, head_dim),
        k_cache=rnd(kv_heads, num_blocks * block_size, head_dim), v_cache=rnd(kv_heads, num_blocks * block_size, head_dim),
    )
    return layout, step


def reference(q, k_cache, v_cache, layout: BatchLayout, scale: float, window: int | None = None,
              softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float64 attention of each query row over its sequence's visible cached positions: the dense
    masked form (transformers' sliding-window mask: the row at position p sees p - window < k <= p;
    softcap * tanh(scores / softcap) before the mask; sinks [H]: each head's sink logit as one more
    column of the softmax, dropped after it, as transformers' GPT-OSS eager attention)."""
    kvh = k_cache.shape[0]
    group = q.shape[1] // kvh
    out, row = [], 0
    for table, ctx, ql in zip(layout.block_tables, layout.context_lens, layout.query_lens, strict=True):
        bs = layout.block_size
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)])
        kk = k_cache[:, slots].double().repeat_interleave(group, 0)  # [H, ctx, D]
        vv = v_cache[:, slots].double().repeat_interleave(group, 0)
        qq = q[row : row + ql].double().transpose(0, 1)  # [H, ql, D]
        scores = qq @ kk.transpose(1, 2) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = (ctx - ql + torch.arange(ql))[:, None]
        visible = torch.arange(ctx)[None, :] <= qpos
        if window is not None:
            visible &= torch.arange(ctx)[None, :] > qpos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            sink = sinks.double().view(-1, 1, 1).expand(-1, ql, 1)  # [H, ql, 1]
            probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
        out.append((probs @ vv).transpose(0, 1))
        row += ql
    return torch.cat(out)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all(), "non-finite output (an unwritten or NaN row)"
    return float((got.double() - want).norm() / want.norm())
