"""The hybrid (Qwen3.5) engine on a GPU (pytest -m gpu on the device): the fused bf16 decode step (Gated
DeltaNet decode kernel, gated partial-rotary attention, zero-centred norm prologues) as close to float32 as
the plain bf16 step at the 27B model's head sizes (and the bf16 prefill with engine.kernels.gdn_chunk as close
as the torch form's), captured in a CUDA graph and replayed to the same bits and
states; the graph-replayed loop gives the CPU's tokens at TP1, and two ranks on one card give TP1's. CPU checks of every kernel: tests/engine/test_engine_hybrid.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.core import config as ecfg
from engine.core import runner, weights
from engine.core.model import Model
from engine.core.sampling import Sampler
from tests.engine_helpers import REPO, restore_state, snapshot_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# the 27B model's per-head shapes (head dim 256 with a quarter rotary, 6 query heads per KV head, linear heads
# of 128 with 3 value heads per key head), fewer heads and layers
REAL_HEADS = dict(model_type="qwen3_5_text", vocab_size=2048, hidden_size=1024, intermediate_size=2048,
                  num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=2, head_dim=256,
                  linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                      "partial_rotary_factor": 0.25})


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _pair():
    from engine.core.device import device_kernels
    from engine.core.weights import expected_tensors

    cfg = ecfg.from_dict(REAL_HEADS)
    models = {}
    ids = torch.randint(0, 2048, (1, 700), generator=torch.Generator().manual_seed(5))
    for dt in (torch.float32, torch.bfloat16):
        m = Model(cfg, dtype=dt, device="cuda")
        m.kernels = device_kernels(m.device)[0]  # as the loader sets it: the card's choice
        g = torch.Generator().manual_seed(7)
        with torch.inference_mode():
            for label, t in expected_tensors(m):
                if label.endswith("a_log"):
                    v = torch.rand(t.shape, generator=g) * 2.7
                elif label.endswith(("dt_bias", "gnorm")):
                    v = 1.0 + 0.2 * torch.randn(t.shape, generator=g)
                else:
                    v = (0.1 if t.dim() == 1 else 0.03) * torch.randn(t.shape, generator=g)
                t.copy_(v)
            m.setup_cache(1280)
            for s in range(0, 700, 256):
                m.forward(ids[:, s:s + 256].cuda(), s)
        models[dt] = m
    return models


def test_fused_bf16_hybrid_step_is_as_close_to_float32_as_the_plain_one_and_replays_in_a_graph():
    from engine.core import timing

    models = _pair()
    tok, pos = torch.tensor([5], device="cuda"), torch.tensor([700], device="cuda")
    with torch.inference_mode():
        ref = models[torch.float32].decode_step(tok, pos, 1024)
        m = models[torch.bfloat16]
        start = snapshot_state(m)
        plain = m.decode_step(tok, pos, 1024)
        restore_state(m, start)
        fused = m.decode_step(tok, pos, 1024, "fused")
        after = snapshot_state(m)
        restore_state(m, start)
        out = {}
        graph = timing.capture(lambda: out.__setitem__("y", m.decode_step(tok, pos, 1024, "fused")))
        restore_state(m, start)  # capture's warm-up ran the step: start again from the same state
        graph.replay()
        torch.cuda.synchronize()
    assert torch.isfinite(fused).all()
    e_plain, e_fused = rel(plain, ref), rel(fused, ref)
    print(f"bf16 logits vs float32: plain {e_plain:.4g}, fused {e_fused:.4g}")
    assert e_fused <= max(1.5 * e_plain, 1e-3)
    assert torch.equal(out["y"], fused)
    for a, b in zip(snapshot_state(m), after):
        assert torch.equal(a, b)


def test_bf16_prefill_with_the_gdn_chunk_kernel_is_as_close_to_float32_as_the_torch_form():
    models = _pair()  # 700 positions prefilled with the card's choice
    ids = torch.randint(0, 2048, (1, 300), generator=torch.Generator().manual_seed(9)).cuda()
    m32, m16 = models[torch.float32], models[torch.bfloat16]
    assert m16.kernels == "fused" and m32.kernels == "fused"  # the default where Triton runs
    runs = {}
    with torch.inference_mode():
        for name, m, kernels in (("ref", m32, "eager"), ("eager", m16, "eager"), ("fused", m16, "fused")):
            start = snapshot_state(m)
            m.kernels = kernels
            logits = m.forward(ids, 700, all_logits=True)
            runs[name] = (logits, [la.rec_state.clone() for la in m.layers if la.kind == "linear_attention"])
            restore_state(m, start)
    (ref, ref_s), (plain, plain_s), (fused, fused_s) = runs["ref"], runs["eager"], runs["fused"]
    e_plain, e_fused = rel(plain, ref), rel(fused, ref)
    print(f"bf16 prefill logits vs float32: torch form {e_plain:.4g}, gdn_chunk {e_fused:.4g}")
    assert torch.isfinite(fused).all() and e_fused <= max(1.5 * e_plain, 1e-3)
    for a, b, r in zip(fused_s, plain_s, ref_s):
        assert rel(a, r) <= max(1.5 * rel(b, r), 1e-3)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The hybrid demo (a Qwen3.5 checkpoint; its CPU tokens are judged against transformers in CI)."""
    from engine.core import demo

    d = tmp_path_factory.mktemp("q35gpu")
    demo.make(d, arch="qwen3_5")
    return d


def test_graph_replayed_decoding_gives_the_cpu_tokens_at_tp1(hf_dir):
    prompt = [1, 17, 200, 42, 5, 99, 7, 250, 11]  # the demo's vocabulary is 256
    cpu = Model(ecfg.load(hf_dir))
    weights.load_into(cpu, hf_dir)
    cpu.setup_cache(512)
    want, _ = runner.run(cpu, prompt, 48, Sampler(), set(), chunk=4)
    gpu = Model(ecfg.load(hf_dir), device="cuda")
    weights.load_into(gpu, hf_dir)
    gpu.setup_cache(512)
    dec = runner.prepare(gpu)
    assert dec.graphs and dec.kernels == "fused"
    got, _ = runner.run(gpu, prompt, 48, Sampler(), set(), chunk=4)
    assert got == want


def test_two_ranks_on_one_gpu_give_the_tp1_tokens(hf_dir):
    prompt = "1,17,200,42,5,99,7,250,11"
    outs = []
    for tp, dev in ((1, "cuda"), (2, "cuda")):  # one card: both ranks on cuda:0
        proc = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(hf_dir), "--tp", str(tp),
                               "--device", dev, "--dtype", "float32", "--prompt-ids", prompt, "--max-tokens", "48",
                               "--json"], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"])
    assert outs[0] == outs[1]


def test_the_gdn_prefill_kernels_compile_once_whatever_the_prompt_length():
    """A prompt of a length not seen before (not a multiple of 16, one chunk, one token) runs the kernels already
    compiled: Triton specialising on T and N compiled new ones on a user's first follow-up turn (~1.4 s)."""
    from triton.runtime import driver

    from engine.kernels import gdn_chunk, gdn_chunk_jit

    g = torch.Generator(device="cuda").manual_seed(3)
    hk, hv, d = 2, 6, 128
    kernels = gdn_chunk_jit.gdn_chunk_prep_kernel, gdn_chunk_jit.gdn_chunk_kernel
    dev = driver.active.get_current_device()
    counts = []
    with torch.inference_mode():
        for t in (80, 201, 64, 1696, 1, 333):
            q, k = (torch.randn(t, hk, d, device="cuda", generator=g, dtype=torch.bfloat16) * 0.1 for _ in range(2))
            v = torch.randn(t, hv, d, device="cuda", generator=g, dtype=torch.bfloat16)
            gate = -torch.rand(t, hv, device="cuda", generator=g)
            beta = torch.rand(t, hv, device="cuda", generator=g)
            state = torch.zeros(hv, d, d, device="cuda")
            o, s = gdn_chunk.chunked(q, k, v, gate, beta, state)
            assert o.shape == (t, hv, d) and torch.isfinite(o).all() and torch.isfinite(s).all()
            counts.append(tuple(len(kern.device_caches[dev][0]) for kern in kernels))
    print("compiled variants after each length:", counts)
    assert all(c == counts[0] for c in counts), counts
