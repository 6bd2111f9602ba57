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

    def allreduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        self._maybe_stall()
        self.calls += 1
        return self.path.allreduce_sum(x)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        self._maybe_stall()
        self.calls += 1
        return self.path.gather_last(x)
