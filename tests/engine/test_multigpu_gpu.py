"""Two-GPU checks (run on the lent two-H200 machine; skipped without two GPUs): the engine's TP2 over
each cross-card allreduce path, one rank per card, generates exactly the tokens TP1 does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import engine_helpers
from tests.engine_helpers import REPO

demo_dir = engine_helpers.demo_dir  # the session fixture, shared with the CPU tests

pytestmark = pytest.mark.gpu


def _two_gpus() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


needs_two = pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA GPUs in one host")


def _generate(model, *extra):
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(model), "--prompt",
                        "Hello there, the world!\n", "--max-tokens", "48", "--json", "--dtype", "float32", *extra],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.fixture(scope="module")
def tp1_tokens(demo_dir):
    one, _ = _generate(demo_dir, "--device", "cuda:0")
    assert len(one["token_ids"]) == 48
    return one["token_ids"]


@needs_two
@pytest.mark.parametrize("path", ["nccl", "device_mailbox", "host_mailbox"])
def test_tp2_across_two_gpus_matches_tp1(demo_dir, tp1_tokens, path):
    two, err = _generate(demo_dir, "--tp", "2", "--device", "cuda", "--allreduce", path)
    assert f"self-test {path}: passed" in err
    assert two["token_ids"] == tp1_tokens


@needs_two
def test_auto_on_two_gpus_trusts_the_race(demo_dir, tp1_tokens):
    two, err = _generate(demo_dir, "--tp", "2", "--device", "cuda")
    assert "timings are not trusted" not in err
    assert "was fastest over 8 KB + 40 KB" in err or "the only path that passed" in err
    assert two["token_ids"] == tp1_tokens
