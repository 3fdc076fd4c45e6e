"""Arrival counters: how a kernel's programs find the last of a group to finish.

A split reduction (split-K attention, a chunked top-k) usually takes a second launch to merge
its programs' partial results. Instead each program of a group stores its partial, then
adds one to the group's counter (an acq_rel atomic at GPU scope, after a CTA barrier); the
program that sees the count reach the group's size merges the partials (read past L1) and
zeroes the counter. So every launch leaves its counters as it found them: zeroed, and
kernels launched one after another on a stream can share one buffer.

`arrival_counters` hands out that buffer: one per device and stream for eager calls, which
every CUDA graph captured on that stream keeps using (the graph holds the address; graphs
captured on one stream are replayed one at a time, as a runner does, and another runner
captures on its own stream). A traced call (fake or functional tensors: torch.compile of
code calling an op) gets a zeroed buffer of its own instead, which its graph allocates.
"""

from __future__ import annotations

import torch

_MIN_COUNTERS = 1 << 14
_counters: dict[tuple[torch.device, int], torch.Tensor] = {}
# Outgrown buffers stay allocated: CUDA graphs captured with them still count in them.
_outgrown: list[torch.Tensor] = []


def arrival_counters(like: torch.Tensor, num_counters: int) -> torch.Tensor:
    """At least `num_counters` zeroed int32 counters on `like`'s device (see the module
    docstring); a buffer too small is replaced by one of the next power of two."""
    if type(like) is not torch.Tensor:
        return torch.zeros(num_counters, dtype=torch.int32, device=like.device)
    stream = 0
    if like.device.type == "cuda":
        stream = torch.cuda.current_stream(like.device).stream_id
    key = (like.device, stream)
    counters = _counters.get(key)
    if counters is None or counters.numel() < num_counters:
        if counters is not None:
            _outgrown.append(counters)
        size = max(_MIN_COUNTERS, 1 << (num_counters - 1).bit_length())
        counters = torch.zeros(size, dtype=torch.int32, device=like.device)
        _counters[key] = counters
    return counters
