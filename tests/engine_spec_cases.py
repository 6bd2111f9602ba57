"""Cases run by tests/engine/test_engine_spec_graphs.py in a child pytest under Triton's interpreter (TRITON_INTERPRET=1;
the file name keeps the main run from collecting it): the verification's kernels on CPU tensors. The T-row
residual add + RMSNorm (engine.kernels.rows_norm) against model.rms_norm, and the whole verification body with the
kernels (the fused Gated DeltaNet decode kernel per row, the row norms) against the torch body."""

from __future__ import annotations

import os

import pytest
import torch

from engine.core import config as ecfg
from engine.core import weights
from engine.core.model import Model, rms_norm
from engine.core.spec_graphs import SpecGraphs
from engine.kernels import decode, rows_norm

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/engine/test_engine_spec_graphs.py with TRITON_INTERPRET=1", allow_module_level=True)

CFG = dict(model_type="qwen3_5_text", vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
           linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
           max_position_embeddings=128, mtp_num_hidden_layers=1, rms_norm_eps=1e-6,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    monkeypatch.setattr(decode, "CPU_KERNELS", True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zc", [False, True])
def test_the_row_norm_kernel_rounds_as_the_torch_norm(dtype, zc):
    g = torch.Generator().manual_seed(3)
    x, d = (torch.randn(1, 5, 96, generator=g).to(dtype) for _ in range(2))  # 96: not a power of two
    w = (0.1 * torch.randn(96, generator=g)).to(dtype) + (0 if zc else 1)
    xo, h = rows_norm.add_norm(x, d, w, 1e-6, zc)
    assert torch.equal(xo, x + d)
    heads = x.view(1, 5, 3, 32)[..., :16]  # q heads as the verification norms them: a strided view, rows of 16
    for got, want in ((h, rms_norm(x + d, w, 1e-6, zc)),
                      (rows_norm.norm(heads, w[:16], 1e-6, zc), rms_norm(heads, w[:16], 1e-6, zc))):
        assert got.shape == want.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:  # one bf16 step at most where the float32 statistics differ in their last bits
            assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
            assert (got != want).float().mean() < 0.02


def test_the_verification_body_with_the_kernels_equals_the_torch_body(kernels_on_cpu, monkeypatch):
    m = Model(ecfg.from_dict(CFG))
    weights.init_random(m, seed=4, std=0.2)
    m.setup_cache(64)
    prompt = list(range(1, 20))
    with torch.inference_mode():
        m.forward(torch.tensor([prompt]), 0)
    state = [t for la in m.layers for t in ((la.k_cache, la.v_cache) if la.kind == "full_attention"
                                            else (la.conv_ring, la.rec_state))]
    saved = [t.clone() for t in state]
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(decode, "CPU_KERNELS", fused)
        for t, s in zip(state, saved):
            t.copy_(s)
        sg = SpecGraphs(m, 3, [64])
        sg.tok.copy_(torch.tensor([5, 6, 7, 8]))
        sg.pos.fill_(len(prompt))
        with torch.inference_mode():
            logits = sg.verify(3, 64)
        out[fused] = (logits, sg.hid.clone(), [r.clone() for r in sg.recs], [r.clone() for r in sg.rings])
        with torch.inference_mode():  # the greedy drafts after it (the draft layer's norms: the kernel's too)
            sg.draft(2, 64)
        out[fused] += (sg.tok.tolist(),)
    (lf, hf, rf, cf, df), (lt, ht, rt, ct, dt) = out[True], out[False]
    torch.testing.assert_close(lf, lt, rtol=1e-4, atol=1e-4)
    # float32 sums in the kernels' order and torch's through three layers: a few 1e-5 apart on some CPUs
    torch.testing.assert_close(hf, ht, rtol=1e-4, atol=1e-4)
    for a, b in zip(rf + cf, rt + ct):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert df == dt
