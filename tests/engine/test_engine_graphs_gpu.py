"""GPU checks of the decode step as the service runs it (run on the lent device; skipped without CUDA):
graph replays equal eager steps, the ranks capture their step with the allreduce inside on two GPUs and
generate exactly TP1's tokens, and two ranks on one GPU fall back to eager steps with the reason logged."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine import tuning
from engine.kernels import decode
from tests import engine_helpers
from tests.engine_helpers import REPO

demo_dir = engine_helpers.demo_dir

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_gpu = pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA GPUs in one host")


def _generate(model, *extra):
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(model), "--prompt",
                        "Hello there, the world!\n", "--max-tokens", "48", "--json", "--dtype", "float32",
                        "--max-context", "300", *extra], cwd=REPO, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@needs_gpu
@pytest.mark.parametrize("kernels", ["eager", "fused"])
def test_graph_replays_equal_eager_steps(demo_dir, kernels):
    import torch

    from engine.core import config, runner, weights
    from engine.core.model import Model
    from engine.core.sampling import Sampler

    cfg = config.load(demo_dir)
    outs = {}
    for graphs in (False, True):
        m = Model(cfg, dtype=torch.float32, device="cuda:0")
        weights.load_into(m, demo_dir)
        m.setup_cache(300)
        dec = runner.prepare(m, graphs=graphs, kernels=kernels if graphs else "eager")
        assert dec.info["mode"] == ("graphs" if graphs else "eager")
        assert dec.info["windows"] == ([256, 300] if graphs else None)
        outs[graphs], _ = runner.run(m, list(range(3, 250)), 40, Sampler(), set(), 64)  # crosses 256
        if graphs:
            st = dec.stats()
            assert st["steps"] >= 30 and st["step_ms"] > 0 and st["achieved_gbps"] > 0
    assert outs[True] == outs[False]


@needs_two
def test_ranks_capture_the_step_with_the_allreduce_inside_and_match_tp1(demo_dir):
    one, _ = _generate(demo_dir, "--device", "cuda:0")
    two, err = _generate(demo_dir, "--tp", "2", "--device", "cuda")
    assert "decode graphs (CUDA graphs per context bucket, allreduce " in err
    assert "captured inside" in err and "self-test device_mailbox_graph: passed" in err
    assert "lockstep in the step's graph" in err
    assert two["token_ids"] == one["token_ids"]


@needs_gpu
def test_two_ranks_on_one_gpu_decode_eagerly_and_say_why(demo_dir):
    two, err = _generate(demo_dir, "--tp", "2", "--device", "cuda:0")
    # the graph mailbox is not applicable on one GPU (engine.allreduce.select): the ranks wait on the host
    assert "ranks ready: allreduce device_mailbox (self-test device_mailbox: passed)" in err
    assert "decode eager (allreduce device_mailbox waits on the host" in err
    assert len(two["token_ids"]) == 48


@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_triton_gemv_matches_the_float32_product(dtype):
    """The Triton GEMV on ragged shapes (K not a multiple of the block, N not of the rows per program),
    with and without bias, at every configuration the bench tries: as close to the float32 product as
    cuBLAS is, and bit-identical run to run (no split, no atomics)."""
    import torch
    import torch.nn.functional as F

    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(3)
    for n, k in ((333, 1000), (4096, 4096), (75, 4100)):
        w = torch.randn(n, k, device="cuda", dtype=dt, generator=g) * 0.05
        x = torch.randn(1, 1, k, device="cuda", dtype=dt, generator=g)
        b = torch.randn(n, device="cuda", dtype=dt, generator=g)
        for bias in (None, b):
            ref = F.linear(x.float(), w.float(), None if bias is None else bias.float()).view(-1)
            cub = F.linear(x, w, bias).float().view(-1)
            tol = max(1.5 * float((cub - ref).norm() / ref.norm()), 1e-3 if dt != torch.float32 else 1e-5)
            for cfg in tuning.active().gemv_configs:
                out = torch.empty(n, device="cuda", dtype=dt)
                y = decode.launch(x.view(-1), w, bias, out, cfg).float()
                assert float((y - ref).norm() / ref.norm()) <= tol, (n, k, cfg, bias is None)
                again = decode.launch(x.view(-1), w, bias, torch.empty_like(out), cfg).float()
                assert torch.equal(y, again)
            assert decode.linear(x, w, bias).shape == (1, 1, n)
