"""LFM2's gated short convolution over the state cache (engine/state/), in PyTorch (the reference path;
no C++ or Triton kernel yet).

Per token row h [hidden]: in_proj(h) -> B, C, x (each [hidden]); the depthwise causal conv1d with
L_cache taps runs over the sequence's B * x columns; y = C * conv; out_proj(y). The conv window of a
sequence is its last L_cache - 1 B * x columns: kept in its state slot between steps, so a decode reads
L_cache - 1 old columns plus its own, and a prompt chunk cut anywhere carries the window across the cut.
A chunk starting at position 0 reads zeros instead (transformers' left zero padding), which is also how a
preempted request rebuilds its state (recompute). Math as transformers' Lfm2ShortConv, same F.conv1d
call, so float32 results match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import ForwardContext
from engine.state.batch import StateBatch


class DepthwiseConvWeights(nn.Module):
    """The conv's parameters under the checkpoint's names (`conv.weight` [channels, 1, L_cache], `conv.bias`)."""

    def __init__(self, channels: int, taps: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, taps))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


class ShortConv(nn.Module):
    def __init__(self, hidden: int, taps: int, bias: bool, state_index: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.width = taps - 1  # columns of the window kept per sequence
        self.state_index = state_index  # this layer's row of the conv-state tensor (among conv layers only)
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.conv = DepthwiseConvWeights(hidden, taps, bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [T, hidden] (the step's rows, sequences packed one after another) -> [T, hidden]."""
        bcx = self.in_proj(x)  # [T, 3 hidden]
        b, c, v = bcx.chunk(3, dim=-1)
        bx = (b * v).t()  # [hidden, T]: channels first, as conv1d reads them
        conv = self._conv(bx, ctx.state)  # [hidden, T]
        y = (c.t() * conv).t().contiguous()  # [T, hidden]
        return self.out_proj(y)

    def _conv(self, bx: torch.Tensor, state: StateBatch | None) -> torch.Tensor:
        weight, bias = self.conv.weight, self.conv.bias  # [hidden, 1, L], [hidden] | None
        if state is None:  # no state cache (a profiling pass): the whole batch as one fresh sequence
            return _window_conv(self._zeros(bx), bx, weight, bias)[0]
        conv_state = state.conv[self.state_index]  # [slots, hidden, width]
        if state.all_decode:  # every row a decode on its own slot: one batched conv
            assert state.slot_index is not None
            window = conv_state.index_select(0, state.slot_index)  # [B, hidden, width]
            xs = torch.cat([window, bx.t().unsqueeze(-1).to(window.dtype)], dim=-1)  # [B, hidden, L]
            conv_state.index_copy_(0, state.slot_index, xs[:, :, 1:])
            out = F.conv1d(xs.to(weight.dtype), weight, bias, groups=self.hidden)  # [B, hidden, 1]
            return out[:, :, 0].t()
        outs = []
        for at, n, slot, fresh in zip(state.offsets, state.lengths, state.slots, state.fresh, strict=True):
            seg = bx[:, at : at + n]  # [hidden, n]
            window = self._zeros(seg) if fresh else conv_state[slot]  # [hidden, width]
            out, new_window = _window_conv(window, seg, weight, bias)
            conv_state[slot].copy_(new_window)
            outs.append(out)
        return torch.cat(outs, dim=-1)

    def _zeros(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(self.hidden, self.width)


def _window_conv(window: torch.Tensor, seg: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The causal depthwise conv of one sequence's new columns seg [hidden, n] after its window
    [hidden, width]: (output [hidden, n], the new window: the last `width` columns of both together)."""
    xs = torch.cat([window.to(seg.dtype), seg], dim=-1)  # [hidden, width + n]
    out = F.conv1d(xs.unsqueeze(0).to(weight.dtype), weight, bias, groups=seg.shape[0])[0]  # [hidden, n]
    return out, xs[:, xs.shape[1] - window.shape[1] :]
