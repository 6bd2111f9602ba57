"""Prefix reuse (engine/core/prefix.py) on CPU: a request whose prompt starts with what the model last
processed prefills only the rest and answers token for token as a cold engine does, for the dense and the
hybrid demo; the linear-attention snapshots stay within their budget; without the cache nothing is reused;
two ranks that reuse differently disagree in their first lockstep record."""

from __future__ import annotations

import pytest
import torch

from engine.core import config as ecfg
from engine.core import demo, runner, weights
from engine.core.model import Model
from engine.core.sampling import Sampler


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def arch_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"demo-{request.param}")
    demo.make(d, arch=request.param)
    return request.param, d


def _model(d, budget=None):
    m = Model(ecfg.load(d))
    weights.load_into(m, d)
    m.setup_cache(2048)
    runner.prepare(m, prefix_cache_bytes=budget)
    return m


def _turns():
    g = torch.Generator().manual_seed(1)
    a = torch.randint(10, 256, (600,), generator=g).tolist()
    return a


def test_reused_prefixes_answer_as_a_cold_engine(arch_dir):
    arch, d = arch_dir
    cold, warm = _model(d, budget=0), _model(d)
    assert cold.prefix is None and warm.prefix is not None
    a = _turns()
    answers, cached = [], []
    prompts = [a, a]  # the same prompt again
    for i in range(5):
        if i == 2:
            prompts.append(a + answers[0] + [11, 12, 13])  # a follow-up turn: the conversation so far + new text
        elif i == 3:
            prompts.append(a[:450] + [9] * 30)  # shares 450 positions, then differs
        elif i == 4:
            prompts.append(list(range(20, 80)))  # nothing in common
        p = prompts[i]
        info = {}
        want, _ = runner.run(cold, p, 16, Sampler(), set(), 256)
        got, _ = runner.run(warm, p, 16, Sampler(), set(), 256, info=info)
        assert got == want, (arch, i)
        answers.append(got)
        cached.append(info["cached_tokens"])
    assert cached[0] == 0 and cached[1] == len(a) - 1  # all but the last token of the same prompt
    assert cached[2] >= len(a) + 15  # the follow-up reuses the whole conversation the model holds
    # the partial match: K/V of 450 positions are there; a linear-attention state only where a snapshot was
    assert cached[3] == (450 if arch == "llama" else 0)
    assert cached[4] == 0
    assert warm.prefix.hits == sum(c > 0 for c in cached)


def test_snapshots_stay_within_their_budget(tmp_path):
    """Hybrid only: a dense model keeps no snapshots (its K/V stay in the cache)."""
    demo.make(tmp_path, arch="qwen3_5")
    m = _model(tmp_path)
    one = sum(la.conv_ring.numel() * 4 + la.rec_state.numel() * 4 for la in m.prefix.linear)
    m.prefix.budget = 2 * one
    for start in range(4):
        runner.run(m, [start + 10] * 50, 2, Sampler(), set(), 256)
    assert len(m.prefix.snaps) <= 2
    assert sum(sum(t.numel() * t.element_size() for t in c) for _, c in m.prefix.snaps.values()) <= 2 * one


def test_the_first_lockstep_record_differs_when_one_rank_reuses_and_the_other_does_not(arch_dir):
    _, d = arch_dir
    a = _turns()
    records = []
    for budget in (None, 0):
        m = _model(d, budget=budget)
        runner.run(m, a, 4, Sampler(), set(), 256)
        seen = []
        runner.run(m, a, 4, Sampler(), set(), 256, hook=lambda ph, k, toks, pos: seen.append((ph, len(toks), pos)))
        records.append(seen[0])
    assert records[0] != records[1]  # (phase, tokens, position) of the first step: what the ranks exchange


@pytest.mark.parametrize("arch", ["qwen3_5"])
def test_the_service_reuses_a_conversation_at_tp2_and_reports_it(arch, tmp_path):
    """Through HTTP at TP2: a follow-up turn and a repeated prompt report cached tokens and answer exactly as a
    service started with --no-prefix-cache, which reports none."""
    from tests.test_service_support import ServiceProcess

    d = tmp_path / "m"
    demo.make(d, arch=arch)
    conv = _turns()[:400]
    answers: dict[str, list] = {}
    for flags in ((), ("--no-prefix-cache",)):
        svc = ServiceProcess(*flags, model=str(d))
        try:
            svc.wait_healthy()
            model_id = svc.client.get("/v1/models").json()["data"][0]["id"]

            def ask(prompt, svc=svc, model_id=model_id):
                r = svc.client.post("/v1/completions", json={"model": model_id, "prompt": prompt, "max_tokens": 12,
                                                             "temperature": 0.0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                body = r.json()
                return body["v100plan"]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

            first, c0 = ask(conv)
            follow, c1 = ask(conv + first + [30, 31, 32])
            again, c2 = ask(conv + first + [30, 31, 32])
            answers[flags and "cold" or "warm"] = [first, follow, again, (c0, c1, c2)]
            hits = svc.metric("v100plan_prefix_cache_hits_total")
            # /health says per rank whether it reuses prefixes (the acceptance suite waives prefix_reuse on "off")
            decode = svc.health().json()["decode"]
            assert {d["prefix_cache"] for d in decode.values()} == {"off" if flags else "on"}, decode
            answers[(flags and "cold" or "warm") + "_hits"] = hits
        finally:
            svc.stop()
    warm, cold = answers["warm"], answers["cold"]
    assert warm[:3] == cold[:3]  # token for token
    assert cold[3] == (0, 0, 0) and answers["cold_hits"] == 0
    c0, c1, c2 = warm[3]
    assert c0 == 0 and c1 >= len(conv) + 11 and c2 == len(conv) + 12 + 3 - 1
    assert answers["warm_hits"] == 2
