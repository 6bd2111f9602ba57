"""GPU checks of the engine (run on the lent device): two ranks on one GPU over the device mailbox."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import engine_helpers
from tests.engine_helpers import REPO

demo_dir = engine_helpers.demo_dir  # the session fixture, shared with the CPU tests

pytestmark = pytest.mark.gpu


def _generate(model, *extra):
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(model), "--prompt",
                        "Hello there, the world!\n", "--max-tokens", "48", "--json", *extra],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_device_mailbox_two_ranks_on_one_gpu_match_tp1(demo_dir):
    one, _ = _generate(demo_dir, "--device", "cuda:0", "--dtype", "float32")
    two, err = _generate(demo_dir, "--tp", "2", "--device", "cuda:0", "--dtype", "float32",
                         "--allreduce", "device_mailbox")
    assert "allreduce device_mailbox" in err
    assert "self-test device_mailbox: passed" in err
    assert two["token_ids"] == one["token_ids"]
    assert len(two["token_ids"]) == 48


def test_auto_on_one_gpu_skips_nccl_and_does_not_trust_the_race(demo_dir):
    two, err = _generate(demo_dir, "--tp", "2", "--device", "cuda:0", "--dtype", "float16")
    assert "NCCL refuses duplicate devices" in err
    assert "timings are not trusted" in err
    assert "allreduce device_mailbox" in err
    assert len(two["token_ids"]) == 48


def test_device_mailbox_direct_selftest_and_timeout(tmp_path):
    """Both ranks run the device-mailbox self-test, then rank 1 stops answering: rank 0's wait must end
    with PathTimeout within its bound instead of hanging."""
    code = r'''
import sys, time, torch, torch.distributed as dist
from engine.allreduce.dist import init_control
from engine.allreduce.device_mailbox import DeviceMailbox
from engine.allreduce.select import selftest
from engine.allreduce.base import PathTimeout
rank, rdv = int(sys.argv[1]), sys.argv[2]
torch.cuda.set_device(0)
store = init_control(rdv, 5, rank, 2, 30.0)
p = DeviceMailbox(rank, 2.0, device=torch.device("cuda:0"), store=store, generation=5, barrier=dist.barrier)
assert selftest(p, rank, torch.device("cuda:0"), torch.float16) is None
x = torch.full((4096,), float(rank + 1), dtype=torch.bfloat16, device="cuda:0")
s = p.allreduce_sum(x)
assert bool((s == 3).all())
dist.barrier()
if rank == 0:
    t0 = time.monotonic()
    try:
        p.allreduce_sum(x)
        print("NO TIMEOUT")
    except PathTimeout as e:
        print("TIMEOUT", round(time.monotonic() - t0, 1), e)
else:
    time.sleep(4)
'''
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert procs[0].returncode == 0, outs[0][1][-2000:]
    assert procs[1].returncode == 0, outs[1][1][-2000:]
    line = outs[0][0].strip().splitlines()[-1]
    assert line.startswith("TIMEOUT"), line
    assert 1.5 < float(line.split()[1]) < 5.0
