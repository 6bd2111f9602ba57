"""Cases run by tests/engine/test_engine_gdn_chunk.py in a child pytest under Triton's interpreter (TRITON_INTERPRET=1;
the file name keeps the main run from collecting it): engine.kernels.gdn_chunk's prefill kernel against
engine.kernels.gdn's chunked and recurrent forms on CPU tensors. float32 must agree to float32 noise; bf16 must be as
close to float32 as the torch form in bf16 inputs is (at most 1.5x its error)."""

from __future__ import annotations

import os

import pytest
import torch

from engine.kernels import gdn, gdn_chunk

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/engine/test_engine_gdn_chunk.py with TRITON_INTERPRET=1", allow_module_level=True)


def _inputs(t: int, hk: int, hv: int, dk: int, dv: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, hk, dk, generator=g), torch.randn(t, hk, dk, generator=g) * 2
    v = torch.randn(t, hv, dv, generator=g)
    decay, beta = -torch.rand(t, hv, generator=g), torch.rand(t, hv, generator=g)
    s0 = torch.randn(hv, dk, dv, generator=g) * 0.3  # a continued sequence: the state is not zeros
    return q, k, v, decay, beta, s0


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("t,hk,hv,dk,dv,bv", [
    (150, 2, 4, 32, 32, 16),  # T not a multiple of 64, Hv / Hk = 2, two value blocks per head
    (40, 2, 2, 16, 32, None),  # T < 64, Hv / Hk = 1
    (128, 1, 3, 32, 16, None),  # whole chunks, Hv / Hk = 3 (the 27B shape's ratio)
])
def test_the_kernel_equals_the_chunked_and_recurrent_forms_from_a_state(t, hk, hv, dk, dv, bv):
    q, k, v, decay, beta, s0 = _inputs(t, hk, hv, dk, dv)
    o_ref, s_ref = gdn.recurrent(q, k, v, decay, beta, s0)
    o_chunk, s_chunk = gdn.chunked(q, k, v, decay, beta, s0)
    o, s = gdn_chunk.chunked(q, k, v, decay, beta, s0, bv=bv)
    assert o.shape == o_ref.shape and o.dtype == torch.float32 and s.shape == s0.shape
    assert (o - o_chunk).abs().max() < 1e-5 and (s - s_chunk).abs().max() < 1e-5
    assert (o - o_ref).abs().max() < 1e-4 and (s - s_ref).abs().max() < 1e-4
    assert (s0 != s).any()  # the state passed in is not overwritten: a new one comes back


@pytest.mark.parametrize("t,hk,hv", [(150, 2, 4), (64, 1, 3)])
def test_the_parts_kernel_equals_the_torch_parts(t, hk, hv):
    q, k, v, decay, beta, s0 = _inputs(t, hk, hv, 32, 32, seed=5)
    want = gdn.chunk_parts(q, k, v, decay, beta)  # torch's triangular solve for the UT transform
    got = gdn_chunk.prepare(q, k, v, decay, beta)
    assert got[-1] == want[-1] == t
    for name, a, b in zip(("u", "w", "attn", "qd", "kd", "last"), got, want):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-5, name
    o1, s1 = gdn_chunk.chunked(q, k, v, decay, beta, s0)
    o2, s2 = gdn_chunk.chunked(q, k, v, decay, beta, s0, prep="torch")
    assert (o1 - o2).abs().max() < 1e-5 and (s1 - s2).abs().max() < 1e-5
    with pytest.raises(ValueError, match="64 tokens"):
        gdn_chunk.chunked(q, k, v, decay, beta, s0, chunk=32)


def test_bf16_inputs_are_as_close_to_float32_as_the_torch_form():
    q, k, v, decay, beta, s0 = _inputs(150, 2, 4, 32, 32, seed=7)
    o_ref, s_ref = gdn.recurrent(q, k, v, decay, beta, s0)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    o_t, s_t = gdn.chunked(qb, kb, vb, decay, beta, s0)
    o, s = gdn_chunk.chunked(qb, kb, vb, decay, beta, s0)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel(o, o_ref) <= max(1.5 * rel(o_t, o_ref), 1e-3), (rel(o, o_ref), rel(o_t, o_ref))
    assert rel(s, s_ref) <= max(1.5 * rel(s_t, s_ref), 1e-3), (rel(s, s_ref), rel(s_t, s_ref))
