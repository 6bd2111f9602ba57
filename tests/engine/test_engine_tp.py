"""Tensor parallelism on CPU: both ranks hold bit-identical activations and logits, and TP2's logits
match TP1's within float tolerance (two half-width products do not round like one)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.core import config as ecfg
from engine.core import weights
from engine.core.model import Model
from tests import engine_helpers
from tests.engine_helpers import REPO

demo_dir = engine_helpers.demo_dir

# Each rank: build its half of the model over a real path, record a hash of every allreduce result
# (the activations both ranks continue from) and of the gathered logits.
RANK_SCRIPT = r'''
import hashlib, json, sys, threading, torch, torch.distributed as dist
from engine.core import config, weights
from engine.allreduce.dist import init_control
from engine.allreduce.select import build
from engine.allreduce.comm import Comm
from engine.core.model import Model
rank, model_dir, rdv, path_name, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
store = init_control(rdv, 0, rank, 2, 30.0)
path = build(path_name, rank=rank, device=torch.device("cpu"), timeout_s=30.0, abort=threading.Event(),
             rendezvous_dir=rdv, generation=0, store=store, shared_device=False)
hashes = []
class Recording(Comm):
    def allreduce_sum(self, x):
        y = super().allreduce_sum(x)
        hashes.append(hashlib.sha256(y.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
        return y
m = Model(config.load(model_dir), world=2, rank=rank, comm=Recording(path))
weights.load_into(m, model_dir)
m.setup_cache(64)
ids = torch.tensor([[1, 49, 78, 148, 183, 104, 107]])
logits = torch.cat([m.forward(ids[:, :5], 0, all_logits=True), m.forward(ids[:, 5:], 5, all_logits=True)])
torch.save(logits, out + ".pt")
json.dump({"allreduce_hashes": hashes,
           "logits_sha": hashlib.sha256(logits.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()},
          open(out, "w"))
dist.barrier()
'''


@pytest.mark.parametrize("path", ["gloo", "host_mailbox"])
def test_ranks_are_bit_identical_and_match_tp1(demo_dir, tmp_path, path):
    outs = [tmp_path / f"r{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(demo_dir), str(tmp_path / "rdv"),
                               path, str(outs[r])], cwd=REPO, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()[-2000:]
    res = [json.loads(o.read_text()) for o in outs]
    n_layers = ecfg.load(demo_dir).num_layers
    assert len(res[0]["allreduce_hashes"]) == 2 * 2 * n_layers  # two chunks x (o_proj, down_proj) per layer
    assert res[0]["allreduce_hashes"] == res[1]["allreduce_hashes"]
    assert res[0]["logits_sha"] == res[1]["logits_sha"]

    tp2 = torch.load(str(outs[0]) + ".pt")
    m = Model(ecfg.load(demo_dir))
    weights.load_into(m, demo_dir)
    m.setup_cache(64)
    ids = torch.tensor([[1, 49, 78, 148, 183, 104, 107]])
    tp1 = m.forward(ids, 0, all_logits=True)
    diff = (tp2 - tp1).abs().max().item()
    assert diff < 1e-4 * tp1.abs().max().item()
    assert torch.equal(tp2.argmax(-1), tp1.argmax(-1))


def test_a_message_over_the_paths_slot_goes_in_pieces_that_fit():
    """A long prefill chunk's allreduce (2048 tokens x 5120 x 2 bytes = 20 MB) over a 2 MB mailbox slot."""
    from engine.allreduce.comm import Comm

    class Mailbox:
        words = 16  # 64 bytes a message
        sizes: list = []

        def allreduce_sum(self, x):
            assert x.numel() * x.element_size() <= 64
            self.sizes.append(x.numel())
            return x * 2  # rank 0 + rank 1 holding the same

    path = Mailbox()
    x = torch.arange(100, dtype=torch.float32).view(4, 25)
    y = Comm(path).allreduce_sum(x)
    assert torch.equal(y, x * 2) and y.shape == x.shape and path.sizes == [16] * 6 + [4]
