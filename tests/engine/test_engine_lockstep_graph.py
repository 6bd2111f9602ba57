"""Lockstep inside the decode step's graph, on CPU: the running hash wraps like int64 on every device,
and two ranks (threads exchanging through a barrier, as the captured all_gather exchanges between GPUs)
agree step after step, while a corrupted hash, a divergent token or one rank's cancel is seen by both
ranks in the step it happens in. The GPU run of the same code is tests/engine/test_engine_lockstep_gpu.py."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from engine.core import lockstep
from engine.core.lockstep import LockstepFailure


def test_running_hash_wraps_like_int64():
    rng = random.Random(7)
    for _ in range(200):
        h = rng.randrange(-(1 << 63), 1 << 63)
        tok, pos, bad = rng.randrange(0, 200_000), rng.randrange(0, 1 << 17), rng.choice((0, 1))
        got = lockstep.hash_step(torch.tensor([h]), torch.tensor([tok]), torch.tensor([pos]), torch.tensor([bad]))
        assert got.dtype == torch.int64 and int(got) == lockstep.hash_step_ref(h, tok, pos, bad)
    # one flipped bit anywhere changes the hash
    a = lockstep.hash_step_ref(0, 5, 9)
    assert a != lockstep.hash_step_ref(0, 5, 9, 1) and a != lockstep.hash_step_ref(0, 4, 9)
    assert a != lockstep.hash_step_ref(0, 5, 8)


class Pair:
    """Two ranks' all_gather through shared memory and a barrier: (rank 0's x, rank 1's x) on both."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=10)
        self.slots: list = [None, None]

    def all_gather(self, rank: int):
        def gather(x):
            self.slots[rank] = x.clone()
            self.barrier.wait()
            out = (self.slots[0].clone(), self.slots[1].clone())
            self.barrier.wait()
            return out
        return gather


def _run_pair(tokens: list[list[int]], flags: list[list[tuple[int, int]]]) -> list[list[dict]]:
    """Each rank checks its tokens step by step (positions 10, 11, ...); returns each rank's reads."""
    pair, out = Pair(), [[], []]

    def rank(r: int):
        state, fl = torch.zeros(1, dtype=torch.long), torch.zeros(2, dtype=torch.long)
        for k, tok in enumerate(tokens[r]):
            fl.copy_(torch.tensor(flags[r][k]))
            res = lockstep.in_graph(torch.tensor(tok), torch.tensor([10 + k]), state, fl, pair.all_gather(r))
            out[r].append(lockstep.read(res.tolist()))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def test_ranks_agree_then_a_corrupted_hash_fails_in_its_own_step_on_both():
    toks = [3, 14, 15, 92, 65, 35]
    ok = [(0, 0)] * 6
    bad = [(0, 0), (0, 0), (0, 0), (0, 1), (0, 0), (0, 0)]  # rank 1 corrupts its hash at step 3
    reads = _run_pair([toks, toks], [ok, bad])
    for r in (0, 1):
        assert [x["agree"] for x in reads[r]] == [1, 1, 1, 0, 0, 0]  # the running hash stays apart
        assert [x["token"] for x in reads[r]] == toks
        assert reads[r][2]["hash0"] == reads[r][2]["hash1"] != 0
        assert lockstep.judge(reads[r][2], 7, r) is False
        with pytest.raises(LockstepFailure) as e:
            lockstep.judge(reads[r][3], 8, r)
        msg = str(e.value)
        assert msg.startswith(f"LOCKSTEP FAILURE at step 8 (rank {r}), checked inside the decode step's graph")
        assert "hash " in msg and "token " not in msg
    # both ranks saw the same pair of hashes, and the host-side reference gives the same chain
    assert reads[0][3] == reads[1][3]
    h = 0
    for k, t in enumerate(toks[:3]):
        h = lockstep.hash_step_ref(h, t, 10 + k)
    assert reads[0][2]["hash0"] == h


def test_a_divergent_token_and_one_ranks_cancel_are_seen_by_both():
    reads = _run_pair([[1, 2, 3], [1, 2, 4]], [[(0, 0), (1, 0), (0, 0)], [(0, 0)] * 3])
    for r in (0, 1):
        assert [x["cancel"] for x in reads[r]] == [0, 1, 0]  # rank 0's cancel, OR-ed: both stop at step 1
        assert lockstep.judge(reads[r][1], 1, r) is True
        with pytest.raises(LockstepFailure, match=r"token 3 != 4, hash -?\d+ != -?\d+"):
            lockstep.judge(reads[r][2], 2, r)
