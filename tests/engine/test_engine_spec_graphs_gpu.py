"""MTP speculation's captured rounds on a GPU (pytest -m gpu on the device): the verification, draft and rollback
graphs replay their eager bodies to the same logits and states, and graph rounds give exactly the tokens of eager
rounds and of one-token decoding (greedy, across a context bucket's edge; sampled with the same seed). CPU checks
of the bodies: tests/engine/test_engine_spec_graphs.py."""

from __future__ import annotations

import pytest
import torch

from engine.core import config as ecfg
from engine.core import demo, runner, weights
from engine.core.model import Model
from engine.core.sampling import Sampler
from tests.engine_helpers import restore_state, snapshot_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

K = 3
PROMPTS = [[1, 17, 200, 42, 5, 99, 7, 250, 11], [1] + [(13 * i + 7) % 250 + 3 for i in range(239)]]  # 240: the 256 edge


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec-gpu")
    demo.make(d, arch="qwen3_5", mtp=True)
    m = Model(ecfg.load(d), device="cuda")  # float32: eager and captured arithmetic agree to the bit
    weights.load_into(m, d)
    m.setup_cache(1024)
    dec = runner.prepare(m, prefix_cache_bytes=0, spec_tokens=K)
    assert dec.graphs and dec.spec is not None and dec.info["speculation"]["mode"] == "graphs"
    return m


def close(a, b) -> bool:
    """Equal up to float32 rounding (cuBLAS may pick another algorithm inside a capture)."""
    return torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)


def test_the_captured_bodies_replay_to_the_eager_logits_and_states(model):
    sg, prompt = model.decoder.spec, PROMPTS[1]
    n, w = len(prompt), 256
    with torch.inference_mode():
        model.forward(torch.tensor([prompt], device="cuda"), 0)
        start = snapshot_state(model)
        for kk in (K, 1):
            sg.tok[:kk + 1].copy_(torch.tensor([5, 6, 7, 8][:kk + 1]))
            sg.pos.fill_(n)
            eager = sg.verify(kk, w).clone()
            rows = [(r.clone(), s.clone()) for r, s in zip(sg.rings, sg.recs)]
            after = snapshot_state(model)
            restore_state(model, start)
            got = sg.replay_verify(kk, w)
            torch.cuda.synchronize()
            assert close(got, eager) and torch.equal(torch.argmax(got, -1), torch.argmax(eager, -1))
            for (r, s), r2, s2 in zip(rows, sg.rings, sg.recs):
                assert close(r[:kk + 1], r2[:kk + 1]) and close(s[:kk + 1], s2[:kk + 1])
            for a, b in zip(snapshot_state(model), after):
                assert close(a, b)
            sg.replay_rollback(0)
            torch.cuda.synchronize()
            lin = [la for la in model.layers if la.kind == "linear_attention"]
            assert all(torch.equal(la.rec_state, s[0]) and torch.equal(la.conv_ring, r[0])
                       for la, r, s in zip(lin, sg.rings, sg.recs))
            restore_state(model, start)
        # the draft graph: the draft layer's catch-up over 2 rows, then K - 1 one-row steps
        inputs = [t.clone() for t in (sg.tok, sg.argmax, sg.hid)]  # what the draft reads (it rewrites tok)
        sg.pos.fill_(n - 2)
        sg.draft(2, w)
        eager_tok, eager_mtp = sg.tok.clone(), snapshot_state(model)[-2:]
        restore_state(model, start)
        for t, s in zip((sg.tok, sg.argmax, sg.hid), inputs):
            t.copy_(s)
        sg.pos.fill_(n - 2)
        sg.replay_draft(2, w)
        torch.cuda.synchronize()
        assert torch.equal(sg.tok, eager_tok) and int(sg.pos) == n
        assert all(close(a, b) for a, b in zip(snapshot_state(model)[-2:], eager_mtp))


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "bucket-edge"])
def test_graph_rounds_give_the_tokens_of_eager_rounds_and_of_one_token_decoding(model, prompt):
    dec = model.decoder
    plain, _ = runner.run(model, prompt, 40, Sampler(), set(), 64)
    info: dict = {}
    graph, _ = runner.run(model, prompt, 40, Sampler(), set(), 64, info=info, spec_tokens=K)
    sampled = runner.run(model, prompt, 24, Sampler(0.8, seed=3), set(), 64, spec_tokens=K)[0]
    spec, dec.spec = dec.spec, None
    try:
        eager, _ = runner.run(model, prompt, 40, Sampler(), set(), 64, spec_tokens=K)
        eager_sampled = runner.run(model, prompt, 24, Sampler(0.8, seed=3), set(), 64, spec_tokens=K)[0]
    finally:
        dec.spec = spec
    assert graph == eager == plain
    assert info["spec"]["rounds"] > 0 and len(graph) == 1 + info["spec"]["rounds"] + info["spec"]["accepted_tokens"]
    assert sampled == eager_sampled
