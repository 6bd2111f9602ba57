"""The model's view of the chosen allreduce path, plus the fault hook that stalls it on request."""

from __future__ import annotations

import time

import torch


class Comm:
    def __init__(self, path):
        self.path = path
        self.stall_s = 0.0  # > 0: the next exchange sleeps this long first (fault injection only)
        self.calls = 0

    def _maybe_stall(self) -> None:
        if self.stall_s > 0:
            s, self.stall_s = self.stall_s, 0.0
            time.sleep(s)

    def capacity_bytes(self) -> int | None:
        """The largest message the path carries in one exchange (a mailbox's slot), or None: no limit."""
        p = self.path
        for attr, scale in (("max_bytes", 1), ("words", 4), ("slot_words", 4)):
            v = getattr(p, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v * scale
        return None

    def allreduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over both ranks. A message over the path's slot (a long prefill chunk: 2048 tokens x 5120 x
        2 bytes = 20 MB against a 2 MB device mailbox) goes as consecutive pieces that fit; each element is
        still summed rank 0 + rank 1, so the result is the same bits."""
        self._maybe_stall()
        self.calls += 1
        cap = self.capacity_bytes()
        nbytes = x.numel() * x.element_size()
        if cap is None or nbytes <= cap:
            return self.path.allreduce_sum(x)
        flat = x.reshape(-1)
        step = max(1, cap // x.element_size())
        return torch.cat([self.path.allreduce_sum(flat[i:i + step].contiguous())
                          for i in range(0, flat.numel(), step)]).view(x.shape)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        self._maybe_stall()
        self.calls += 1
        return self.path.gather_last(x)
