"""The int8 K/V cache (--kv-cache-dtype int8, engine/core/kvquant.py) on CPU: half the cache bytes, logits within
a stated error of the 16/32-bit cache on the transformers-judged models, the decode step consistent with
prefill, TP2 equal to TP1. Its fused kernel against the plain blocks: tests/engine_hybrid_cases.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.core import config as ecfg
from engine.core import kvquant, weights
from engine.core.model import Model
from tests.engine.test_engine_hybrid import hybrid  # noqa: F401  (the module-scoped transformers-judged hybrid)
from tests.engine_helpers import REPO, make_hf_model

# The bound the engine states (docs/engine.md): relative L2 of the logits against the unquantised cache
# (measured 2026-12-01: 0.12 % on the hybrid, 1.15 % on the shrunk Qwen3-8B with its wide random weights)
LOGITS_REL_ERR = 0.02


def test_quantisation_round_trip_and_scale():
    x = torch.randn(2, 3, 5, 64, generator=torch.Generator().manual_seed(0))
    q, s = kvquant.quantize(x)
    assert q.dtype == torch.int8 and s.shape == (2, 3, 5) and int(q.abs().max()) == 127
    assert torch.allclose(s, x.abs().amax(-1) / 127)
    back = kvquant.dequantize(q, s, torch.float32)
    assert ((back - x).abs() <= s[..., None] / 2 + 1e-7).all()  # half a step at most
    z, zs = kvquant.quantize(torch.zeros(1, 1, 1, 8))
    assert torch.equal(z, torch.zeros_like(z)) and torch.isfinite(zs).all()


def _logits(d, kv: str, ids: torch.Tensor) -> tuple[torch.Tensor, Model]:
    m = Model(ecfg.load(d), kv_dtype=kv)
    weights.load_into(m, d)
    m.setup_cache(512)
    out = torch.cat([m.forward(ids[:, a:a + 64], a, all_logits=True) for a in range(0, ids.shape[1], 64)])
    return out, m


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    make_hf_model("qwen3-8b", d)
    return d


@pytest.mark.parametrize("which", ["hybrid", "dense"])
def test_int8_logits_stay_within_the_stated_error_and_the_cache_halves(which, hybrid, dense_dir):  # noqa: F811
    d = hybrid[2] if which == "hybrid" else dense_dir
    ids = torch.randint(0, 512, (1, 200), generator=torch.Generator().manual_seed(9))
    ref, m_ref = _logits(d, "auto", ids)
    got, m8 = _logits(d, "int8", ids)
    err = float((got - ref).norm() / ref.norm())
    print(f"{which}: int8 K/V logits relative error {err:.5f}")
    assert 0 < err < LOGITS_REL_ERR
    # float32 cache here: int8 is a quarter, plus one float32 scale per position and head
    hd = m8.attention_layers[0].hd
    assert m8.state_bytes()["kv_cache"] == m_ref.state_bytes()["kv_cache"] * (hd + 4) // (4 * hd)
    # the decode step reads the same cache as prefill writes: the static step equals prefill of that token
    with torch.inference_mode():
        m8.forward(ids[:, :100], 0)
        eager = m8.forward(ids[:, 100:101], 100)
        m8.forward(ids[:, :100], 0)
        static = m8.decode_step(ids[0, 100:101], torch.tensor([100]), 256)
    assert (eager - static).abs().max().item() < 1e-5


def test_an_unknown_kv_dtype_is_refused():
    with pytest.raises(ValueError, match="kv cache dtype 'fp8' is not supported"):
        Model(ecfg.from_dict({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                              "num_hidden_layers": 1, "num_attention_heads": 1}), kv_dtype="fp8")


def test_tp2_with_an_int8_cache_gives_tp1_tokens(hybrid):  # noqa: F811
    d = hybrid[2]
    outs = []
    for tp in ("1", "2"):
        proc = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(d), "--tp", tp,
                               "--kv-cache-dtype", "int8", "--prompt-ids", "1,17,300,42,5", "--max-tokens", "32",
                               "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"])
    assert outs[0] == outs[1]
