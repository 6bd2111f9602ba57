"""Cases run by tests/engine/test_engine_hybrid.py in a child pytest under Triton's interpreter (TRITON_INTERPRET=1;
the file name keeps the main run from collecting it): the hybrid's fused decode kernels (the Gated DeltaNet
decode kernel, the gated / partial-rotary / zero-centred attention, the zero-centred norm prologues) against
the plain torch blocks on CPU tensors, whole decode steps and the states they leave. float32 must agree to
rounding; bf16 must be as close to float32 as the plain bf16 blocks are (at most 1.5x their error)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from engine.core import config as ecfg
from engine.core.model import Model
from engine.core.weights import expected_tensors
from engine.kernels import decode
from tests.engine_helpers import restore_state, snapshot_state

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/engine/test_engine_hybrid.py with TRITON_INTERPRET=1", allow_module_level=True)

CFG = dict(model_type="qwen3_5_text", vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
           linear_num_value_heads=6, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
           max_position_embeddings=256, rms_norm_eps=1e-6,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


@pytest.fixture(autouse=True)
def kernels_on_cpu(monkeypatch):
    monkeypatch.setattr(decode, "CPU_KERNELS", True)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _model(dtype=torch.float32, kv_dtype="auto", **override) -> Model:
    model = Model(ecfg.from_dict(dict(CFG, **override)), dtype=dtype, device="cpu", kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        for label, t in expected_tensors(model):
            if label.endswith("a_log"):
                t.copy_(torch.rand(t.shape, generator=g) * 2.7)
            elif label.endswith("dt_bias") or label.endswith("gnorm"):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            else:
                t.copy_((0.1 if t.dim() == 1 else 0.08) * torch.randn(t.shape, generator=g))
        model.setup_cache(96)
        # a history: 40 positions prefilled, so the conv ring, the states and the K/V cache are not zeros
        model.forward(torch.randint(0, 128, (1, 40), generator=g), 0)
    return model


@pytest.mark.parametrize("kv,override", [("auto", {}), ("auto", {"linear_num_value_heads": 2}),
                                         ("auto", {"num_key_value_heads": 4}), ("int8", {})])
def test_fused_hybrid_decode_steps_give_the_plain_ones_and_the_same_states(kv, override):
    model = _model(kv_dtype=kv, **override)
    start = snapshot_state(model)
    with torch.inference_mode():
        want = [model.decode_step(torch.tensor([t]), torch.tensor([40 + i]), 64) for i, t in enumerate((5, 9, 77))]
        want_states = snapshot_state(model)
        restore_state(model, start)
        got = [model.decode_step(torch.tensor([t]), torch.tensor([40 + i]), 64, "fused")
               for i, t in enumerate((5, 9, 77))]
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-5 and int(a.argmax()) == int(b.argmax())
    for a, b in zip(snapshot_state(model), want_states):
        if a.dtype == torch.int8:  # a rounding tie may land one step apart
            assert (a.int() - b.int()).abs().max() <= 1
        else:
            assert torch.allclose(a.float(), b.float(), atol=1e-5), (a - b).abs().max()


def test_fused_decode_at_the_first_positions_reads_zero_padding():
    model = _model()
    with torch.inference_mode():
        model.forward(torch.tensor([[3]]), 0)  # one token: the ring's earlier slots are the conv's zero padding
        s = snapshot_state(model)
        want = model.decode_step(torch.tensor([4]), torch.tensor([1]), 64)
        restore_state(model, s)
        got = model.decode_step(torch.tensor([4]), torch.tensor([1]), 64, "fused")
    assert rel(got, want) < 1e-5


def test_one_fused_decode_token_enters_the_files_docs_engine_md_lists():
    """docs/engine.md, "One decode token": the hybrid step's six product files and two lookups (*_jit.py apart)."""
    from engine.core import runner
    from tests.paths import REPO

    dec, seen = runner.Decoder(_model()), set()
    dec.kernels = "fused"  # (a CPU decoder chooses the plain blocks; the interpreter runs the kernels here)
    with torch.inference_mode():
        dec.logits(5, 40)  # the first step imports and compiles
        sys.setprofile(lambda frame, event, arg: seen.add(frame.f_code.co_filename))
        dec.logits(9, 41)
        sys.setprofile(None)
    engine = {f.removeprefix(f"{REPO}/") for f in seen if f.startswith(f"{REPO}/engine/") and not f.endswith("_jit.py")}
    assert engine == {f"engine/{f}.py" for f in ("core/runner", "core/model", "model/attention", "model/gdn", "model/base",
                                                 "kernels/decode", "tuning/__init__", "kernels/exchange")}, engine


def test_fused_bf16_is_as_close_to_float32_as_the_plain_bf16_blocks():
    ref = _model(torch.float32)
    bf = _model(torch.bfloat16)
    with torch.inference_mode():
        for (_, a), (_, b) in zip(expected_tensors(bf), expected_tensors(ref)):
            a.copy_(b.to(torch.bfloat16))
        bf.setup_cache(96)
        ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
        ref.setup_cache(96)
        ref.forward(ids, 0)
        bf.forward(ids, 0)
        want = ref.decode_step(torch.tensor([5]), torch.tensor([40]), 64)
        s = snapshot_state(bf)
        plain = bf.decode_step(torch.tensor([5]), torch.tensor([40]), 64)
        restore_state(bf, s)
        fused = bf.decode_step(torch.tensor([5]), torch.tensor([40]), 64, "fused")
    e_plain, e_fused = rel(plain, want), rel(fused, want)
    assert e_fused <= max(1.5 * e_plain, 1e-3), (e_fused, e_plain)


@pytest.mark.parametrize("apart", [False, True])
def test_fused_int8_attention_of_a_dense_model_gives_the_plain_int8_step(apart, monkeypatch):
    from tests.engine_helpers import small_config

    # the step's own position inside its tile, or apart (the default when the loop is pipelined: the interpreter
    # ignores num_stages, so STAGES 3 only selects the apart path here)
    monkeypatch.setattr(decode, "APART", apart)
    monkeypatch.setattr(decode, "STAGES", 3 if apart else 1)

    raw = small_config("qwen3-8b")
    raw.update(head_dim=64)
    model = Model(ecfg.from_dict(raw), dtype=torch.float32, device="cpu", kv_dtype="int8")
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for label, t in expected_tensors(model):
            t.copy_(torch.randn(t.shape, generator=g) * (0.1 if t.dim() == 1 else 0.05) + (1.0 if "norm" in label else 0.0))
        model.setup_cache(96)
        model.forward(torch.randint(0, 512, (1, 50), generator=g), 0)
        s = snapshot_state(model)
        want = model.decode_step(torch.tensor([5]), torch.tensor([50]), 64)
        restore_state(model, s)
        got = model.decode_step(torch.tensor([5]), torch.tensor([50]), 64, "fused")
    assert rel(got, want) < 1e-5


def _prefill_two_chunks(model, ids, kernels):
    """The logits of every position of ids (two chunks after the model's 40 positions) and the states after."""
    model.kernels = kernels
    with torch.inference_mode():
        first = model.forward(ids[:, :30], 40, all_logits=True)  # a chunk boundary inside the 50 tokens
        return torch.cat([first, model.forward(ids[:, 30:], 70, all_logits=True)]), snapshot_state(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_the_gdn_chunk_kernel_gives_the_torch_forms_logits_and_states(dtype):
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(5))
    model = _model(dtype)  # 40 positions already in: the chunks continue the states
    with torch.inference_mode():
        start = snapshot_state(model)
    want, want_states = _prefill_two_chunks(model, ids, "eager")
    with torch.inference_mode():
        restore_state(model, start)
    got, got_states = _prefill_two_chunks(model, ids, "fused")
    if dtype == torch.float32:
        assert rel(got, want) < 1e-5 and torch.equal(got.argmax(-1), want.argmax(-1))
        for a, b in zip(got_states, want_states):  # a later layer's state: its inputs already differ by ~1e-6,
            assert rel(a, b) < 1e-4, rel(a, b)  # which the UT transform's inverse amplifies (seen: 2.4e-5)
        return
    ref, ref_states = _prefill_two_chunks(_model(torch.float32), ids, "eager")  # the same weights in float32
    assert rel(got, ref) <= max(1.5 * rel(want, ref), 1e-3), (rel(got, ref), rel(want, ref))
    rec = [i for i, t in enumerate(got_states) if t.shape[-2:] == (32, 32)]  # the recurrent states
    for i in rec:
        assert rel(got_states[i], ref_states[i]) <= max(1.5 * rel(want_states[i], ref_states[i]), 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_batched_gdn_decode_kernel_gives_each_row_the_one_row_kernels_output_and_states(dtype):
    """decode.gdn_decode_rows (the batched step's Gated DeltaNet mix: programs per value head and row, each row's
    slot's ring and state in the pools, in place) against decode.gdn_decode on each row's slot alone: outputs,
    rings and states bit for bit; the slot no row names untouched; and against the torch form (gdn_mix_rows)."""
    from engine.model.gdn import gdn_mix_rows

    g = torch.Generator().manual_seed(23)
    nk, nv, dk, dv, ks, slots_n = 2, 6, 32, 32, 4, 4
    chans = 2 * nk * dk + nv * dv
    rings = (0.5 * torch.randn(slots_n, chans, ks, generator=g)).to(dtype)
    recs = 0.1 * torch.randn(slots_n, nv, dk, dv, generator=g)
    conv_w = (0.3 * torch.randn(chans, ks, generator=g)).to(dtype)
    a_log, dt_bias = torch.rand(nv, generator=g).to(dtype), (1 + 0.2 * torch.randn(nv, generator=g)).to(dtype)
    gnorm = (1 + 0.2 * torch.randn(dv, generator=g)).to(dtype)
    slots, pos = torch.tensor([2, 0, 3]), torch.tensor([7, 40, 2])
    proj = torch.randn(3, chans + nv * dv + 2 * nv, generator=g).to(dtype)
    kw = dict(nk=nk, nv=nv, dk=dk, dv=dv, eps=1e-6)
    r_rows, s_rows = rings.clone(), recs.clone()
    y = decode.gdn_decode_rows(proj, r_rows, conv_w, a_log, dt_bias, gnorm, s_rows, pos, slots, **kw)
    r_one, s_one = rings.clone(), recs.clone()
    for i, (sl, p) in enumerate(zip(slots.tolist(), pos.tolist())):
        alone = decode.gdn_decode(proj[i], r_one[sl], conv_w, a_log, dt_bias, gnorm, s_one[sl], torch.tensor([p]),
                                  **kw)
        assert torch.equal(y[i], alone), i
    assert torch.equal(r_rows, r_one) and torch.equal(s_rows, s_one)
    assert torch.equal(r_rows[1], rings[1]) and torch.equal(s_rows[1], recs[1])  # slot 1: no row names it
    r_t, s_t = rings.clone(), recs.clone()
    ref = gdn_mix_rows(proj, r_t, conv_w, a_log, dt_bias, gnorm, s_t, pos, slots, **kw)
    assert rel(y, ref) < (1e-5 if dtype is torch.float32 else 2e-2) and rel(s_rows, s_t) < 1e-5


@pytest.mark.parametrize("dtype,int8", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_the_batched_attention_kernel_gives_each_row_its_one_row_output_and_cache(dtype, int8):
    """decode.decode_attention with slots (the batched step's attention: a grid axis over rows, each row's K/V
    written and read in its own slot of the pools) against the one-row launch on each row's slot alone, Qwen3.5's
    form (gated, partial rotary, zero-centred q/k norms): outputs and caches bit for bit with the same programs per
    row; the slot no row names untouched; with the default programs (shared out over the rows) within rounding."""
    g = torch.Generator().manual_seed(29)
    n_heads, n_kv, hd, rot, ctx, slots_n, w = 4, 2, 64, 16, 96, 4, 64
    kdt = torch.int8 if int8 else dtype
    kp = (torch.randint(-100, 100, (slots_n, n_kv, ctx, hd), generator=g).to(kdt) if int8
          else torch.randn(slots_n, n_kv, ctx, hd, generator=g).to(dtype))
    vp = (torch.randint(-100, 100, (slots_n, n_kv, ctx, hd), generator=g).to(kdt) if int8
          else torch.randn(slots_n, n_kv, ctx, hd, generator=g).to(dtype))
    ksp = 0.01 * torch.rand(slots_n, n_kv, ctx, generator=g) if int8 else None
    vsp = 0.01 * torch.rand(slots_n, n_kv, ctx, generator=g) if int8 else None
    slots, pos = torch.tensor([3, 0, 2]), torch.tensor([5, 50, 63])
    qkv = torch.randn(3, (2 * n_heads + 2 * n_kv) * hd, generator=g).to(dtype)
    ang = pos[:, None].float() * torch.rand(rot, generator=g)[None]
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    qn, kn = (0.1 * torch.randn(hd, generator=g)).to(dtype), (0.1 * torch.randn(hd, generator=g)).to(dtype)
    kw = dict(n_heads=n_heads, n_kv=n_kv, hd=hd, eps=1e-6, window=w, gated=True, zc=True)

    def pools():
        return [t.clone() if t is not None else None for t in (kp, vp, ksp, vsp)]

    rk, rv, rks, rvs = pools()
    got = decode.decode_attention(qkv, cos, sin, pos, qn, kn, rk, rv, k_scale=rks, v_scale=rvs, slots=slots,
                                  splits=2, **kw)
    ok, ov, oks, ovs = pools()
    for i, sl in enumerate(slots.tolist()):
        one = slice(sl, sl + 1)
        alone = decode.decode_attention(qkv[i], cos[i:i + 1], sin[i:i + 1], pos[i:i + 1], qn, kn, ok[one], ov[one],
                                        k_scale=oks[one] if int8 else None, v_scale=ovs[one] if int8 else None,
                                        splits=2, **kw)
        assert torch.equal(got[i], alone[0]), i
    assert torch.equal(rk, ok) and torch.equal(rv, ov) and (not int8 or torch.equal(rks, oks))
    assert torch.equal(rk[1], kp[1]) and torch.equal(rv[1], vp[1])  # slot 1: no row names it
    rk, rv, rks, rvs = pools()
    default = decode.decode_attention(qkv, cos, sin, pos, qn, kn, rk, rv, k_scale=rks, v_scale=rvs, slots=slots,
                                      **kw)
    assert rel(default, got) < (1e-5 if dtype is torch.float32 else 1e-2)


def test_the_batched_step_on_the_kernels_gives_each_sequence_its_fused_one_sequence_step():
    """Model.decode_batch where the kernels run (the batched attention and Gated DeltaNet kernels, torch products):
    three sequences in slots 2, 0, 3 of four, at different positions, against each alone through decode_step's
    fused kernels: logits within float32 rounding, the same greedy tokens over six steps, states alike."""
    torch.manual_seed(0)
    model = Model(ecfg.from_dict(CFG), dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(31)
    with torch.inference_mode():
        for _, t in expected_tensors(model):
            t.copy_((0.1 if t.dim() == 1 else 0.08) * torch.randn(t.shape, generator=g))
        model.setup_cache(96, slots=4)
        slots = [2, 0, 3]
        prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 30, 17)]
        firsts = [int(model.prefill_slot(s, p).argmax()) for s, p in zip(slots, prompts)]
        saved = snapshot_state(model)
        toks, pos = list(firsts), [len(p) for p in prompts]
        together = []
        for _ in range(6):
            logits = model.decode_batch(torch.tensor(toks), torch.tensor(pos), torch.tensor(slots), 64)
            together.append(logits)
            toks, pos = logits.argmax(-1).tolist(), [p + 1 for p in pos]
        batched_states = snapshot_state(model)
        restore_state(model, saved)
        for i, s in enumerate(slots):
            model.use_slot(s)
            tok, p = firsts[i], len(prompts[i])
            for step in range(6):
                one = model.decode_step(torch.tensor([tok]), torch.tensor([p]), 64, kernels="fused")
                assert rel(together[step][i], one) < 1e-5, (i, step)
                tok, p = int(one.argmax()), p + 1
                assert tok == int(together[step][i].argmax()), (i, step)
        model.use_slot(0)
        for a, b in zip(snapshot_state(model), batched_states):
            assert rel(a, b) < 1e-5
