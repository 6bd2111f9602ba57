"""Qwen3-Next's decode step on a GPU (pytest -m gpu on the device): captured in CUDA graphs with its MoE layers
(top-k routing and the gathered experts inside the graph), float32 greedy tokens equal to transformers' on the
CPU, and the bf16 fused path as close to float32 as the plain bf16 blocks. CPU checks: tests/engine/test_engine_next.py."""

from __future__ import annotations

import pytest
import torch

from engine.core import config as ecfg
from engine.core import runner, weights
from engine.core.model import Model
from engine.core.sampling import Sampler
from tests.engine.test_engine_next import N_TOKENS, PROMPT, checkpoint


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def nxt(tmp_path_factory):
    """(the CPU suite's checkpoint, transformers' greedy tokens on the CPU)."""
    d = tmp_path_factory.mktemp("qwen3_next")
    return d, checkpoint(d)[1]


def _on_gpu(d, dtype) -> Model:
    m = Model(ecfg.load(d), dtype=dtype, device="cuda")
    weights.load_into(m, d)
    m.setup_cache(256)
    return m


def _states(m) -> list:
    return [t for la in m.layers if la.kind == "linear_attention" for t in (la.conv_ring, la.rec_state)]


def _restore(m, saved) -> None:
    for t, v in zip(_states(m), saved):
        t.copy_(v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_captured_moe_step_gives_transformers_tokens(nxt):
    """float32, the plain blocks in CUDA graphs (float32 Triton kernels may use TF32 products: the fused path is
    judged in bf16 below)."""
    d, ref = nxt
    m = _on_gpu(d, torch.float32)
    dec = runner.prepare(m, graphs=True, kernels="eager")
    assert dec.graphs and dec.info["capture_s"] is not None  # captured: no host sync inside the step
    out, reason = runner.run(m, PROMPT, N_TOKENS, Sampler(), set(), chunk=4)
    assert reason == "length" and out == ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_fused_bf16_moe_step_is_as_close_to_float32_as_the_plain_one_and_captures(nxt):
    from engine.core import timing

    d, _ = nxt
    ref, bf = _on_gpu(d, torch.float32), _on_gpu(d, torch.bfloat16)
    ids = torch.tensor([PROMPT], device="cuda")
    tok, pos = torch.tensor([5], device="cuda"), torch.tensor([len(PROMPT)], device="cuda")
    with torch.inference_mode():
        ref.forward(ids, 0)
        want = ref.decode_step(tok, pos, 64)
        bf.forward(ids, 0)
        saved = [t.clone() for t in _states(bf)]
        plain = bf.decode_step(tok, pos, 64)
        _restore(bf, saved)
        fused = bf.decode_step(tok, pos, 64, "fused")
        out = {}
        graph = timing.capture(lambda: out.__setitem__("y", bf.decode_step(tok, pos, 64, "fused")))
        replays = []
        for _ in range(2):  # each replay from the same states (the warm-up calls and replays advance them)
            _restore(bf, saved)
            graph.replay()
            torch.cuda.synchronize()
            replays.append(out["y"].clone())
    assert torch.isfinite(fused).all()
    assert rel(fused, want) <= max(1.5 * rel(plain, want), 1e-3), (rel(fused, want), rel(plain, want))
    assert torch.equal(replays[0], replays[1])
    assert int(replays[0].argmax()) == int(fused.argmax()) and rel(replays[0], fused) < 1e-2
