"""The fused decode kernels on a GPU (pytest -m gpu on the device): whole bf16 decode steps with the
fused blocks as close to float32 as the plain bf16 step, captured in a CUDA graph and replayed
bit-identically. CPU checks of every kernel: tests/engine/test_engine_fused_kernels.py."""

from __future__ import annotations

import pytest
import torch

from engine.core import runner
from tests.engine_helpers import small_config


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,override", [("qwen3-8b", {"head_dim": 128, "hidden_size": 512, "num_attention_heads": 8,
                                                          "num_key_value_heads": 2}), ("llama-3.1-8b", {})])
def test_on_the_gpu_fused_steps_match_the_plain_step_in_bf16_and_in_a_graph(name, override):
    """bf16 on the device: the fused step as close to float32 as the plain bf16 step (x1.5 + 1e-3, the
    variants bench's bar), captured in a CUDA graph and replayed bit-identically."""
    from engine.core import config as ecfg
    from engine.core import timing
    from engine.core.model import Model
    from engine.core.weights import expected_tensors

    raw = small_config(name)
    raw.update(override, num_hidden_layers=4)
    cfg = ecfg.from_dict(raw)
    models = {}
    for dt in (torch.float32, torch.bfloat16):
        m = Model(cfg, dtype=dt, device="cuda")
        g = torch.Generator().manual_seed(7)
        with torch.inference_mode():
            for label, t in expected_tensors(m):
                t.copy_(torch.empty(t.shape).normal_(1.0 if "norm" in label else 0.0,
                                                     0.1 if t.dim() == 1 else 0.05, generator=g))
            m.setup_cache(1280)
            for layer in m.layers:
                layer.k_cache.copy_(torch.empty(layer.k_cache.shape).normal_(generator=g))
                layer.v_cache.copy_(torch.empty(layer.v_cache.shape).normal_(generator=g))
        models[dt] = m
    tok, pos = torch.tensor([5], device="cuda"), torch.tensor([1000], device="cuda")
    with torch.inference_mode():
        ref = models[torch.float32].decode_step(tok, pos, 1024)
        m = models[torch.bfloat16]
        plain = m.decode_step(tok, pos, 1024)
        fused = m.decode_step(tok, pos, 1024, runner.fused_blocks())
        out = {}
        graph = timing.capture(lambda: out.__setitem__("y", m.decode_step(tok, pos, 1024, runner.fused_blocks())))
        graph.replay()
        torch.cuda.synchronize()
        first = out["y"].clone()
        graph.replay()
        torch.cuda.synchronize()
    assert torch.isfinite(fused).all()
    assert rel(fused, ref) <= max(1.5 * rel(plain, ref), 1e-3)
    assert torch.equal(first, fused) and torch.equal(out["y"], first)
