"""Lockstep: after every prefill chunk and decode step both ranks exchange what they just did and stop
if anything differs, so a divergent token is never handed out.

The record is (step, tokens this step, hash of those tokens and the sampler's RNG
offset, position after the step, cancel flag). Everything but the cancel flag must
be equal on both ranks; the cancel flags are OR-ed, so both ranks stop on the same step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import torch

FIELDS = ("step", "n_tokens", "hash", "position", "cancel")


class LockstepFailure(RuntimeError):
    """The ranks disagree: the message starts with LOCKSTEP FAILURE and names the fields."""


@dataclasses.dataclass(frozen=True)
class Record:
    step: int
    n_tokens: int
    hash: int
    position: int
    cancel: int

    def as_list(self) -> list[int]:
        return [self.step, self.n_tokens, self.hash, self.position, self.cancel]


def token_hash(tokens: list[int], rng_offset: int) -> int:
    """63-bit hash of the step's tokens and the RNG offset (fits an int64 on every transport)."""
    h = hashlib.blake2b(struct.pack(f"<{len(tokens) + 1}q", rng_offset, *tokens), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class Lockstep:
    def __init__(self, path, device: torch.device, rank: int):
        self.path = path
        self.device = device
        self.rank = rank

    def exchange(self, rec: Record) -> bool:
        """Compare with the peer; returns the OR-ed cancel flag, raises LockstepFailure on any difference."""
        mine = torch.tensor(rec.as_list(), dtype=torch.int64, device=self.device)
        r0, r1 = (t.to("cpu").tolist() for t in self.path.all_gather(mine))
        diffs = [f"{f} {a} != {b}" for f, a, b in zip(FIELDS[:4], r0[:4], r1[:4]) if a != b]
        if diffs:
            raise LockstepFailure(f"LOCKSTEP FAILURE at step {rec.step} (rank {self.rank}): rank 0 vs rank 1: "
                                  + ", ".join(diffs))
        return bool(r0[4] or r1[4])
