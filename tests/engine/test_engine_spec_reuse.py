"""A sampled speculative answer after a prefix reuse is the cold answer: the MTP draft layer's K/V at the reused
positions is what a cold prefill leaves (engine.core.prefix ``drafted``), so the drafts, the rejection rule's draws
and the drafted / accepted counts are the cold run's. TP1 in-process and TP2 over two rank processes."""

from __future__ import annotations

import pytest

from engine.core import config as ecfg
from engine.core import mtp, runner, weights
from engine.core.model import Model
from engine.core.sampling import Sampler

CHUNK = 16
CONTEXT = 256
K = 3
PROMPT = [1] + [(7 * i + 3) % 250 + 3 for i in range(36)]  # 37 tokens: three prefill chunks
TOKENS = 24
TEMPERATURE, SEED = 3.0, 3  # a flat distribution: the drafts are often accepted, so they steer the draws


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


def _load(d, prefix_bytes: int) -> Model:
    m = Model(ecfg.load(d))
    weights.load_into(m, d)
    m.setup_cache(CONTEXT)
    runner.prepare(m, prefix_cache_bytes=prefix_bytes)
    return m


@pytest.fixture(scope="module")
def cold(mtp_demo_dir):
    """No prefix cache: every request prefills from position 0."""
    return _load(mtp_demo_dir, 0)


@pytest.fixture()
def warm(mtp_demo_dir):
    """A fresh model with a prefix cache (each test builds its own history)."""
    return _load(mtp_demo_dir, 1 << 24)


@pytest.fixture()
def drafts(monkeypatch):
    """Every round's drafts as mtp.draft proposed them (the real proposal, recorded; a call for no drafts, where
    the draft layer only catches up for the prefix cache, proposes nothing)."""
    seen: list[list[int]] = []
    real = mtp.draft

    def spy(*a, **kw):
        d, qs = real(*a, **kw)
        if d:
            seen.append(list(d))
        return d, qs

    monkeypatch.setattr(mtp, "draft", spy)
    return seen


def _run(m, prompt, drafts, temperature=TEMPERATURE, spec=K, tokens=TOKENS):
    drafts.clear()
    info: dict = {}
    out, _ = runner.run(m, prompt, tokens, Sampler(temperature, 1.0, SEED), set(), CHUNK, info=info,
                        spec_tokens=spec)
    return {"tokens": out, "drafts": list(drafts), "cached": info["cached_tokens"],
            "counts": {k: info["spec"][k] for k in ("draft_tokens", "accepted_tokens", "rounds")} if spec else None}


def _same(a: dict, b: dict) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["counts"] == b["counts"]
    assert a["drafts"] == b["drafts"]


def test_tp1_the_same_prompt_again_answers_as_cold_after_a_request_that_did_not_speculate(cold, warm, drafts):
    ref = _run(cold, PROMPT, drafts)
    assert ref["counts"]["accepted_tokens"] > 0  # some drafts were accepted: the drafts steered the draws
    _run(warm, PROMPT, drafts, temperature=0.0, spec=0)  # the model holds the prompt; the draft layer never ran
    first = _run(warm, PROMPT, drafts)
    _same(first, ref)
    assert first["cached"] == 0  # the draft layer's K/V over the prompt is not there: nothing to reuse
    again = _run(warm, PROMPT, drafts)  # now it is: all but the last prompt token reused
    assert again["cached"] == len(PROMPT) - 1
    _same(again, ref)
    # the greedy answer without speculation and its own reuse are untouched by the draft layer's bookkeeping
    plain = _run(warm, PROMPT, drafts, temperature=0.0, spec=0)
    assert plain["cached"] == len(PROMPT) - 1 and plain["tokens"] == _run(cold, PROMPT, drafts, 0.0, 0)["tokens"]


@pytest.mark.parametrize("temperature", [TEMPERATURE, 0.0])
def test_tp1_a_follow_up_reusing_the_answer_answers_as_cold(cold, warm, drafts, temperature):
    first = _run(warm, PROMPT, drafts, temperature)
    follow = PROMPT + first["tokens"] + [50, 51, 52]
    ref = _run(cold, follow, drafts, temperature)
    got = _run(warm, follow, drafts, temperature)
    assert got["cached"] == len(PROMPT) + TOKENS - 1  # the whole exchange but the answer's last token
    _same(got, ref)
    # a third turn on top, and back to the first prompt (a snapshot one token before its end)
    third = follow + got["tokens"] + [60, 61]
    _same(_run(warm, third, drafts, temperature), _run(cold, third, drafts, temperature))
    back = _run(warm, PROMPT, drafts, temperature)
    assert back["cached"] == len(PROMPT) - 1
    _same(back, _run(cold, PROMPT, drafts, temperature))


def test_tp1_a_reuse_shorter_than_the_model_holds_when_the_draft_layer_lags(cold, warm, drafts):
    # the model ran over a longer prompt without speculating; the draft layer only over the shorter one
    _run(warm, PROMPT, drafts)
    longer = PROMPT + [90, 91, 92, 93]
    _run(warm, longer, drafts, temperature=0.0, spec=0)
    got = _run(warm, longer + [94], drafts)
    _same(got, _run(cold, longer + [94], drafts))
    assert got["cached"] == len(PROMPT) - 1  # the snapshot where both the model and the draft layer hold it


# ---- TP2: two rank processes over gloo, speculating on every request ------------------------------------------

def _pair(d, monkeypatch, prefix_cache: bool):
    import dataclasses

    from engine.service import launcher

    settings = launcher._settings
    monkeypatch.setattr(launcher, "_settings", lambda *a, **kw: dataclasses.replace(
        settings(*a, **kw), no_prefix_cache=not prefix_cache))
    return launcher.RankPair(str(d), ["cpu", "cpu"], "float32", "gloo", CONTEXT, timeout_s=60, draft_tokens=K)


def _ask(pair, rid: str, prompt: list[int]) -> dict:
    from engine.service import protocol

    tokens, done = pair.generate(protocol.generate(rid, prompt, TOKENS, TEMPERATURE, 1.0, SEED), timeout_s=300)
    assert tokens[0] == tokens[1]  # the ranks drew alike
    spec = [{k: dn["decode"]["spec"][k] for k in ("draft_tokens", "accepted_tokens")} for dn in done]
    assert spec[0] == spec[1]
    return {"tokens": tokens[0], "counts": spec[0], "cached": done[0]["cached_tokens"]}


TURNS = [[50, 51, 52], [60, 61], [70, 71, 72, 73]]  # what the user adds after each answer


@pytest.mark.slow
def test_tp2_a_conversation_with_reuse_answers_as_a_pair_without_a_prefix_cache(mtp_demo_dir, monkeypatch):
    warm, prompts = [], [PROMPT]
    pair = _pair(mtp_demo_dir, monkeypatch, prefix_cache=True)
    try:
        warm.append(_ask(pair, "w0", PROMPT))
        again = _ask(pair, "w0-again", PROMPT)
        for i, extra in enumerate(TURNS):
            prompts.append(prompts[-1] + warm[-1]["tokens"] + extra)
            warm.append(_ask(pair, f"w{i + 1}", prompts[-1]))
    finally:
        pair.close()
    assert again["cached"] == len(PROMPT) - 1 and again["tokens"] == warm[0]["tokens"]
    assert again["counts"] == warm[0]["counts"]
    # each turn reused the whole conversation before it but the last answer's last token
    assert [w["cached"] for w in warm[1:]] == [len(p) - len(extra) - 1 for p, extra in zip(prompts[1:], TURNS)]
    pair = _pair(mtp_demo_dir, monkeypatch, prefix_cache=False)
    try:
        cold = [_ask(pair, f"c{i}", p) for i, p in enumerate(prompts)]
    finally:
        pair.close()
    assert all(c["cached"] == 0 for c in cold)
    assert [w["tokens"] for w in warm] == [c["tokens"] for c in cold]
    assert [w["counts"] for w in warm] == [c["counts"] for c in cold]
    assert sum(c["counts"]["accepted_tokens"] for c in cold) > 0
