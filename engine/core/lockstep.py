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


# ---- lockstep inside the decode step's CUDA graph ---------------------------------------------------
# Greedy tokens on graphs: after the captured argmax, each rank forms [token, running hash, cancel flag]
# and exchanges it through the step's own capturable path (one tiny all_gather in the same graph); the
# GPU computes whether the two agree. The host reads token, agree flag, the OR-ed cancel and both ranks'
# token and hash in the one read-back it already makes for the token: no eager exchange per token.
# The running hash mixes every token and position since the decoder was built, so both ranks' hashes
# are equal only while they have replayed exactly the same steps.
MIX_TOKEN = 1099511628211  # FNV-1a's 64-bit prime
MIX_POS = 0x5851F42D4C957F2D  # a 63-bit odd constant (PCG's multiplier)
GRAPH_FIELDS = ("token", "agree", "cancel", "token0", "hash0", "token1", "hash1")


def hash_step(h: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor, corrupt: torch.Tensor) -> torch.Tensor:
    """The running hash's next value (int64 tensors [1]; wraps modulo 2^64); ``corrupt`` is XOR-ed in
    (0 but under fault injection)."""
    return ((h ^ tok) * MIX_TOKEN) ^ (pos * MIX_POS) ^ corrupt


def hash_step_ref(h: int, tok: int, pos: int, corrupt: int = 0) -> int:
    """hash_step in Python integers (two's complement int64), for tests and messages."""
    def s64(v: int) -> int:
        v &= (1 << 64) - 1
        return v - (1 << 64) if v >> 63 else v

    return s64(s64(s64((h ^ tok) * MIX_TOKEN) ^ s64(pos * MIX_POS)) ^ corrupt)


def kernels_here(device: torch.device) -> bool:
    """The two-kernel form of in_graph: CUDA devices where Triton targets the card (8.0+, as the engine's
    kernels); elsewhere (the V100, CPUs) the torch ops."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def in_graph(tok: torch.Tensor, pos: torch.Tensor, state: torch.Tensor, flags: torch.Tensor, all_gather,
             kernels: bool | None = None) -> torch.Tensor:
    """Inside the step's graph. tok: the argmax (int64, 0-d or [1]); pos [1]; state [1] the running hash
    (updated in place); flags [2] = (cancel, corrupt) written by the host before the replay; all_gather:
    the path's capturable exchange. Returns int64 [7] in GRAPH_FIELDS order. ``kernels``: the same in two
    Triton kernels around the exchange instead of ~15 small torch ops (default where kernels_here)."""
    if kernels if kernels is not None else kernels_here(tok.device):
        from engine.kernels import lockstep_jit

        msg = torch.empty(3, dtype=torch.int64, device=tok.device)
        lockstep_jit.pre[(1,)](tok, pos, state, flags, msg, MIX_T=MIX_TOKEN, MIX_P=MIX_POS)
        a, b = all_gather(msg)
        out = torch.empty(7, dtype=torch.int64, device=tok.device)
        lockstep_jit.post[(1,)](msg, a, b, out)
        return out
    t = tok.view(1).to(torch.int64)
    h = hash_step(state, t, pos, flags[1:2])
    state.copy_(h)
    a, b = all_gather(torch.cat([t, h, flags[0:1]]))  # rank 0's [token, hash, cancel], rank 1's
    agree = (a[:2] == b[:2]).all().view(1).to(torch.int64)
    return torch.cat([t, agree, a[2:3] | b[2:3], a[:2], b[:2]])


def read(values: list[int]) -> dict:
    """The host's view of in_graph's output (after ``.tolist()``)."""
    return dict(zip(GRAPH_FIELDS, values))


def judge(checked: dict, step: int, rank: int) -> bool:
    """A token checked inside the graph: the OR-ed cancel flag, or LockstepFailure naming what differs."""
    if not checked["agree"]:
        diffs = [f"{f} {checked[f + '0']} != {checked[f + '1']}" for f in ("token", "hash")
                 if checked[f + "0"] != checked[f + "1"]]
        raise LockstepFailure(f"LOCKSTEP FAILURE at step {step} (rank {rank}), checked inside the decode step's "
                              f"graph: rank 0 vs rank 1: " + ", ".join(diffs or ["agree flag 0"]))
    return bool(checked["cancel"])
