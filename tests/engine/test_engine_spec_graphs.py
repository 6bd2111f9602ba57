"""The captured speculative round's bodies (engine.core.spec_graphs) against the eager verification and drafts
(engine.core.mtp), on CPU where they run eagerly: the same logits, hidden states, per-position linear-attention
states and K/V; the rollback equals the eager one; and the host side of a graph round (one read-back,
the accepted count, the rollback) gives exactly one-token decoding's tokens with the bodies standing in for the
replays; the kernels under Triton's interpreter (tests/engine_spec_cases.py). The graphs themselves:
tests/engine/test_engine_spec_graphs_gpu.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.core import config as ecfg
from engine.core import demo, mtp, runner, weights
from engine.core.model import Model
from engine.core.sampling import Sampler
from engine.core.spec_graphs import SpecGraphs
from tests.engine_helpers import (
    interpreter_spec,
    restore_state,
    run_interpreter_cases,
    snapshot_state,
    state_tensors,
)

PROMPT = [1] + [(7 * i + 3) % 250 + 3 for i in range(20)]
K = 3
WINDOW = 64


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


@pytest.fixture(scope="module")
def model(mtp_demo_dir):
    d = mtp_demo_dir
    m = Model(ecfg.load(d))
    weights.load_into(m, d)
    m.setup_cache(WINDOW)
    runner.prepare(m, prefix_cache_bytes=0)
    return m


def _prefilled(m: Model) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill PROMPT (the draft layer too) -> (a copy of every state, the last position's hidden state)."""
    pre = mtp.Prefill(m, PROMPT, 0)
    _, hidden = m.forward(torch.tensor([PROMPT]), 0, hidden=True)
    pre.chunk(0, hidden)
    return snapshot_state(m), pre.pending


def test_the_verification_body_equals_the_eager_verification(model):
    saved, _ = _prefilled(model)
    n, seq = len(PROMPT), [40, 41, 42, 43]
    states: list = []
    logits, hid = model.forward(torch.tensor([seq]), n, all_logits=True, hidden=True, states=states)
    after = snapshot_state(model)
    restore_state(model, saved)
    sg = SpecGraphs(model, K, [WINDOW])
    sg.tok.copy_(torch.tensor(seq))
    sg.pos.fill_(n)
    got = sg.verify(K, WINDOW)
    torch.testing.assert_close(got, logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sg.hid, hid, rtol=1e-4, atol=1e-5)
    assert sg.argmax.tolist() == torch.argmax(logits, -1).tolist()
    assert sg.out.tolist() == seq + sg.argmax.tolist()
    for (rings, recs), r, s in zip(states, sg.rings, sg.recs):  # every position's states, as the eager path keeps
        torch.testing.assert_close(r, rings, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s, recs, rtol=1e-4, atol=1e-5)
    for a, b in zip(state_tensors(model), after):  # K/V at n..n+K and the states after the last row
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    lin = [la for la in model.layers if la.kind == "linear_attention"]
    for a in (2, 0, 1):  # the rollback: the states after row a, as the eager rollback's
        sg.rollback(a)
        for la, r, s, (rings, recs) in zip(lin, sg.rings, sg.recs, states):
            assert torch.equal(la.conv_ring, r[a]) and torch.equal(la.rec_state, s[a])
            torch.testing.assert_close(la.rec_state, recs[a], rtol=1e-4, atol=1e-5)
            assert not torch.allclose(la.rec_state, s[K])  # the test can fail: the rows' states differ


def test_the_draft_body_drafts_what_the_eager_drafts_do(model):
    saved, pending = _prefilled(model)
    n = len(PROMPT)
    first = int(torch.argmax(model.forward(torch.tensor([PROMPT[-1:]]), n - 1)))  # any token: the drafts follow it
    restore_state(model, saved)
    drafts, _ = mtp.draft(model, Sampler(), K, [first], pending[None], n - 1)
    eager_mtp = snapshot_state(model)[-2:]  # the draft layer's K/V
    restore_state(model, saved)
    sg = SpecGraphs(model, K, [WINDOW])
    sg.argmax[:1].fill_(first)
    sg.hid[:1].copy_(pending[None])
    sg.pos.fill_(n - 1)
    sg.draft(1, WINDOW)
    assert sg.tok.tolist() == [first] + drafts and int(sg.pos) == n
    for a, b in zip(state_tensors(model)[-2:], eager_mtp):
        torch.testing.assert_close(a[:, :, :n + K], b[:, :, :n + K], rtol=1e-4, atol=1e-5)


class BodiesAsReplays(SpecGraphs):
    """The graphs' bodies run where the replays would: the host side of graph rounds on CPU."""

    def replay_draft(self, rows: int, window: int) -> None:
        self.draft(rows, window)

    def replay_verify(self, kk: int, window: int) -> torch.Tensor:
        return self.verify(kk, window)

    def replay_rollback(self, a: int) -> None:
        self.rollback(a)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_graph_rounds_give_exactly_the_tokens_of_one_token_decoding(model, k):
    dec = model.decoder
    ref, _ = runner.run(model, PROMPT, 12, Sampler(), set(), 8)
    try:
        dec.spec = BodiesAsReplays(model, k, [WINDOW])
        info: dict = {}
        out, reason = runner.run(model, PROMPT, 12, Sampler(), set(), 8, info=info, spec_tokens=k)
        s = info["spec"]
        assert (out, reason) == (ref, "length")
        assert len(out) == 1 + s["rounds"] + s["accepted_tokens"] and s["draft_tokens"] > 0
        # sampled rounds draft eagerly and verify through the same body: TP1's eager rounds draw the same tokens
        eager, _ = _sampled(model, None, k)
        assert _sampled(model, dec.spec, k)[0] == eager
    finally:
        dec.spec = None


def _sampled(model, spec, k):
    model.decoder.spec = spec
    return runner.run(model, PROMPT, 8, Sampler(0.8, seed=11), set(), 8, spec_tokens=k)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed: the kernels cannot run (pip install triton)")
@pytest.mark.early(interpreter_spec("tests/engine_spec_cases.py"))
def test_the_verification_kernels_match_the_torch_body_under_the_triton_interpreter():
    run_interpreter_cases("tests/engine_spec_cases.py", 5)


def test_a_failed_capture_of_the_rounds_falls_back_to_eager_rounds_and_says_why(tmp_path, monkeypatch):
    from engine.core import config as ecfg
    from engine.core import spec_graphs

    demo.make(tmp_path, arch="qwen3_5", mtp=True)
    m = Model(ecfg.load(tmp_path))
    weights.load_into(m, tmp_path)
    m.setup_cache(512)
    monkeypatch.setattr(runner.Decoder, "capture", lambda self: setattr(self, "graphs", True))  # as on a GPU

    def broken(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(spec_graphs.SpecGraphs, "capture", broken)
    dec = runner.prepare(m, spec_tokens=3)
    assert dec.spec is None
    info = dec.info["speculation"]
    assert info["mode"] == "eager" and "operation not permitted" in info["why"] and info["draft_tokens"] == 3
