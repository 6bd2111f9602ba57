"""A prefill chunk's attention over the cached prefix (engine.core.prefill_attention): every form equals the
explicit softmax with the lower-right causal rule; on a GPU (pytest -m gpu on the device) the flash and the
per-KV-group forms equal it too and a chunk at the end of a long prefix allocates no [T, prefix] scores."""

from __future__ import annotations

import math

import pytest
import torch

from engine.core import prefill_attention


def _reference(q, k, v, pos0):
    """softmax(q k^T / sqrt(d)) v in float64, query i seeing keys 0..pos0 + i, KV head j serving query heads
    j*g .. j*g + g - 1."""
    g = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(g, dim=1) for x in (k, v))
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    t, n = q.shape[2], k.shape[2]
    allowed = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(diagonal=n - t)
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v


def _inputs(h, kv, t, pos0, d, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, h, t, d, generator=g, device=device).to(dtype)
    k = torch.randn(1, kv, pos0 + t, d, generator=g, device=device).to(dtype)
    v = torch.randn(1, kv, pos0 + t, d, generator=g, device=device).to(dtype)
    return q, k, v


@pytest.mark.parametrize("pos0,t", [(0, 37), (50, 37), (50, 1), (3, 64)])
def test_cpu_forms_equal_the_explicit_softmax(pos0, t):
    q, k, v = _inputs(6, 2, t, pos0, 32, torch.float32, "cpu")
    out = prefill_attention.attend(q, k, v, pos0)
    assert torch.allclose(out.double(), _reference(q, k, v, pos0), atol=2e-6)


@pytest.mark.parametrize("per_group", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pos0,t", [(0, 300), (700, 300), (4096, 64)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_forms_equal_the_explicit_softmax(per_group, dtype, pos0, t):
    q, k, v = _inputs(12, 2, t, pos0, 256, dtype, "cuda")  # the 27B head dim, 6 query heads per KV head
    out = prefill_attention.attend(q, k, v, pos0, per_group=per_group)
    ref = _reference(q, k, v, pos0)
    err = (out.double() - ref).abs().max().item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 3e-3), err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_chunk_at_the_end_of_a_long_prefix_allocates_no_scores():
    # 2048 queries over 64K keys, 12 heads: float32 scores would be 12 x 2048 x 65536 x 4 = 6.4 GB
    q, k, v = _inputs(12, 2, 2048, 65536 - 2048, 256, torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = prefill_attention.attend(q, k, v, 65536 - 2048)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 1 << 30, extra  # the output (12 MB) and the kernel's workspace, not gigabytes
    # and the last query (which sees every key) equals the reference computed for it alone
    ref = _reference(q[:, :, -1:], k, v, 65536 - 1)
    assert (out[:, :, -1:].double() - ref).abs().max().item() < 2e-2
