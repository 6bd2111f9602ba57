"""The rank's batch loop (engine/service/rank_batch.py, `serve --max-concurrency N`) driven round by round in one
process (TP1; the served TP2 pair is tests/service/test_service_concurrency.py): prefix reuse per slot while other
slots run; MTP speculation per slot (--speculative mtp); prompts with images beside text ones; the answers equal
to what the one-sequence runner answers cold (greedy, float32)."""

from __future__ import annotations

import queue

import pytest

from engine.core import config as ecfg
from engine.core import demo, runner, weights
from engine.core.model import Model
from engine.core.sampling import Sampler
from engine.service import protocol
from engine.service.rank_batch import BatchLoop
from tests.engine.test_engine_mtp_packed import checkpoints  # noqa: F401 (a fixture: the packed hybrid + MTP)

CONTEXT = 256
CHUNK = 16
P = [1] + [(11 * i + 7) % 250 + 3 for i in range(40)]  # 41 tokens: three prefill chunks
OTHER = [1] + [(17 * i + 2) % 250 + 3 for i in range(20)]
ANSWER = 12

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


class _Rank:
    """What the batch loop reads of engine.service.rank.Rank, for one process (no peer, no lockstep)."""

    def __init__(self, model: Model, spec_tokens: int = 0, vision=None):
        self.model, self.spec_tokens, self.vision = model, spec_tokens, vision
        self.requests: queue.Queue = queue.Queue()
        self.cancel_log: list[str] = []
        self.path = self.lockstep = None
        self.counter, self.busy = 0, False

    def prefill_chunk(self) -> int:
        return CHUNK

    def constraint_for(self, spec):
        return None

    def step_faults(self, k: int) -> bool:
        return False

    def log_line(self, msg: str) -> None:
        pass

    def decode_stats(self) -> dict:
        return {}


class _Sink:
    def __init__(self):
        self.msgs: list[dict] = []

    def send(self, msg: dict) -> None:
        self.msgs.append(msg)


class Loop:
    """A BatchLoop of n slots on ``model`` with a test's view of its messages."""

    def __init__(self, model: Model, n: int, prefix: bool = True, spec_tokens: int = 0, vision=None):
        model.setup_cache(CONTEXT, slots=n)
        runner.prepare(model, prefix_cache_bytes=None if prefix else 0, spec_tokens=spec_tokens)
        self.sink = _Sink()
        self.loop = BatchLoop(_Rank(model, spec_tokens, vision), self.sink, n)

    def send(self, rid: str, ids: list[int], max_tokens: int = ANSWER, **kw) -> None:
        self.loop.rank.requests.put(protocol.generate(rid, ids, max_tokens, **kw))

    def done(self, rid: str) -> dict | None:
        return next((m for m in self.sink.msgs if m.get("id") == rid and m["type"] in ("done", "error")), None)

    def tokens(self, rid: str) -> list[int]:
        return [m["token_id"] for m in self.sink.msgs if m["type"] == "token" and m["id"] == rid]

    def until(self, pred, limit: int = 5000) -> None:
        for _ in range(limit):
            if pred():
                return
            self.loop.round(block=False)
        raise AssertionError("the batch loop did not get there")

    def answer(self, rid: str) -> tuple[list[int], dict]:
        self.until(lambda: self.done(rid) is not None)
        d = self.done(rid)
        assert d["type"] == "done", d
        return self.tokens(rid), d

    def slot_of(self, rid: str) -> int | None:
        return next((s for s, q in self.loop.running.items() if q.rid == rid), None)


def _load(d) -> Model:
    m = Model(ecfg.load(d))
    weights.load_into(m, d)
    return m


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"batch-{request.param}")
    demo.make(d, arch=request.param)
    return _load(d)


def cold(m: Model, ids: list[int], n: int = ANSWER, spec_tokens: int = 0, prefix: bool = False,
         temperature: float = 0.0, seed: int = 0) -> list[int]:
    """The one-sequence runner's answer from nothing (one slot; no prefix cache unless ``prefix``)."""
    m.setup_cache(CONTEXT)
    runner.prepare(m, prefix_cache_bytes=None if prefix else 0, spec_tokens=spec_tokens)
    out, _ = runner.run(m, ids, n, Sampler(temperature, 1.0, seed), set(), CHUNK, spec_tokens=spec_tokens)
    return out


def test_a_follow_up_reuses_its_conversation_while_another_stream_runs(model):
    first_ref = cold(model, P)
    follow = P + first_ref + [60, 61, 62]
    follow_ref, other_ref = cold(model, follow), cold(model, OTHER, 80)
    lp = Loop(model, 3)
    lp.send("a", P)
    first, d = lp.answer("a")
    assert first == first_ref and d["cached_tokens"] == 0
    lp.send("b", OTHER, 80)  # a long stream: running the whole time the follow-up is served
    lp.until(lambda: len(lp.tokens("b")) >= 5)
    lp.send("f", follow)
    got, d = lp.answer("f")
    assert lp.done("b") is None and lp.slot_of("b") is not None  # the other stream still runs
    assert d["cached_tokens"] == len(P) + ANSWER - 1  # the whole exchange but the answer's last token
    assert got == follow_ref
    lp.send("a2", P)  # the first prompt again: its slot now holds the follow-up, which starts with it
    got, d = lp.answer("a2")
    assert d["cached_tokens"] == len(P) - 1 and got == first_ref
    other, _ = lp.answer("b")
    assert other == other_ref


def test_a_new_prompt_takes_a_slot_nobody_can_reuse_and_a_reset_slot_answers_cold(model):
    ref = [cold(model, ids) for ids in (P, OTHER, P[:20] + [9, 9, 9])]
    lp = Loop(model, 2)
    lp.send("a", P)
    lp.answer("a")
    slot_a = lp.loop.ended.index(max(lp.loop.ended))
    lp.send("b", OTHER)  # reuses nothing: the slot that never served, not a's
    lp.until(lambda: lp.slot_of("b") is not None)
    assert lp.slot_of("b") != slot_a
    got, d = lp.answer("b")
    assert got == ref[1] and d["cached_tokens"] == 0
    # shares 20 of the 52 tokens a's slot holds: not enough to choose that slot for it, but it is the slot that
    # ended longest ago, so it reuses what it can there (dense: 20; hybrid: no snapshot at 20, nothing)
    lp.send("c", P[:20] + [9, 9, 9])
    lp.until(lambda: lp.slot_of("c") is not None)
    assert lp.slot_of("c") == slot_a
    got, d = lp.answer("c")
    assert got == ref[2]
    linear = any(la.kind == "linear_attention" for la in model.layers)
    assert d["cached_tokens"] == (0 if linear else 20)


def test_without_a_prefix_cache_nothing_is_reused(model):
    ref = cold(model, P)
    lp = Loop(model, 2, prefix=False)
    for rid in ("a", "b"):
        lp.send(rid, P)
        got, d = lp.answer(rid)
        assert got == ref and d["cached_tokens"] == 0


# ---- MTP speculation per slot ----------------------------------------------------------------------------------
K = 3
THREE = [P, OTHER, [1] + [(5 * i + 9) % 250 + 3 for i in range(30)]]


@pytest.fixture(scope="module")
def mtp_model(mtp_demo_dir):
    return _load(mtp_demo_dir)


def _together(lp: Loop, prompts: list[list[int]], n: int, **kw) -> list[tuple[list[int], dict]]:
    """The prompts sent a round apart (each admitted while the earlier ones run), answered."""
    for i, ids in enumerate(prompts):
        lp.send(f"r{i}", ids, n, **kw)
        lp.until(lambda i=i: lp.slot_of(f"r{i}") is not None)
    assert len(lp.loop.running) == len(prompts)  # all of them in their slots at once
    return [lp.answer(f"r{i}") for i in range(len(prompts))]


def test_three_speculating_requests_at_once_each_answer_their_solo_tokens(mtp_model):
    want = [cold(mtp_model, ids, 24) for ids in THREE]  # greedy one token at a time, no speculation
    lp = Loop(mtp_model, 3, spec_tokens=K)
    solo = [lp.answer(lp.send(f"s{i}", ids, 24) or f"s{i}") for i, ids in enumerate(THREE)]
    assert [t for t, _ in solo] == want
    lp = Loop(mtp_model, 3, spec_tokens=K)  # fresh slots: nothing to reuse
    got = _together(lp, THREE, 24)
    assert [t for t, _ in got] == want
    for _, d in got:  # it did speculate: the demo's random draft layer is nearly always wrong (rolled back)
        assert d["decode"]["spec"]["draft_tokens"] > 0 and d["cached_tokens"] == 0


def test_a_gptq_checkpoint_three_at_once_answers_its_solo_tokens_plain_and_speculating(checkpoints):  # noqa: F811
    """The packed (GPTQ int4) hybrid with its packed draft layer: three greedy requests at once, through the batched
    step's packed products of three rows, each answer the one-sequence runner's; speculating per slot too."""
    m = _load(checkpoints[0])
    assert m.weights_info()["format"].startswith("gptq-int4")
    want = [cold(m, ids, 16) for ids in THREE]
    for k in (0, K):
        got = _together(Loop(m, 3, spec_tokens=k), THREE, 16)
        assert [t for t, _ in got] == want, f"spec_tokens={k}"


def test_accepted_drafts_in_one_slot_and_rejected_ones_in_another_leave_every_answer_exact(mtp_model, monkeypatch):
    """Drafts that are the true continuation for the first ``good`` of each round (the slot's own request's),
    wrong after: each slot accepts and rolls back on its own, and every answer is still its solo answer."""
    from engine.core import mtp

    want = [cold(mtp_model, ids, 24) for ids in THREE]
    lp = Loop(mtp_model, 3, spec_tokens=K)
    good = {"r0": 3, "r1": 2, "r2": 0}
    full = {f"r{i}": ids + w for i, (ids, w) in enumerate(zip(THREE, want))}

    def draft(model, sampler, k, tokens, hidden, pos0):
        rid = lp.loop.running[model.layers[0].slot].rid  # the slot the round runs in
        pos = pos0 + len(tokens)
        true = full[rid][pos + 1:pos + 1 + k]
        true += [0] * (k - len(true))
        return [t if j < good[rid] else (t + 1) % model.cfg.vocab_size for j, t in enumerate(true)], [None] * k

    monkeypatch.setattr(mtp, "draft", draft)
    got = _together(lp, THREE, 24)
    assert [t for t, _ in got] == want
    counts = [d["decode"]["spec"] for _, d in got]
    assert counts[0]["accepted_tokens"] == counts[0]["draft_tokens"] > 0 and counts[0]["rounds"] < 10
    assert 0 < counts[1]["accepted_tokens"] < counts[1]["draft_tokens"]
    assert counts[2]["accepted_tokens"] == 0 and counts[2]["rounds"] == 23


def test_sampled_speculation_per_slot_is_the_one_at_a_time_runner_s(mtp_model):
    """Seeded sampling with drafts (the rejection rule draws from each request's own generator): three at once each
    draw what the one-at-a-time runner draws, token for token."""
    # a flat distribution (temperature 3): drafts are often accepted, so they steer the draws
    want = [cold(mtp_model, ids, 20, K, prefix=True, temperature=3.0, seed=7 + i) for i, ids in enumerate(THREE)]
    lp = Loop(mtp_model, 3, spec_tokens=K)
    for i, ids in enumerate(THREE):
        lp.send(f"r{i}", ids, 20, temperature=3.0, seed=7 + i)
    got = [lp.answer(f"r{i}") for i in range(3)]
    assert [t for t, _ in got] == want
    assert sum(d["decode"]["spec"]["accepted_tokens"] for _, d in got) > 0


def test_a_speculating_follow_up_reuses_its_slot_and_drafts_as_cold(mtp_model):
    first = cold(mtp_model, P, ANSWER, K)
    follow = P + first + [50, 51, 52]
    want = cold(mtp_model, follow, ANSWER, K, prefix=True)
    cold_counts = None
    lp = Loop(mtp_model, 2, spec_tokens=K)
    lp.send("cold", follow)
    cold_counts = lp.answer("cold")[1]["decode"]["spec"]
    lp = Loop(mtp_model, 2, spec_tokens=K)
    lp.send("a", P)
    assert lp.answer("a")[0] == first
    lp.send("b", OTHER, 60)
    lp.until(lambda: len(lp.tokens("b")) >= 3)
    lp.send("f", follow)
    got, d = lp.answer("f")
    assert lp.slot_of("b") is not None
    assert d["cached_tokens"] == len(P) + ANSWER - 1 and got == want
    assert d["decode"]["spec"] == cold_counts  # the reused draft layer drafted what a cold one drafts


# ---- images --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vdemo(tmp_path_factory):
    from engine.core.tokenizer import Tokenizer
    from engine.vision import demo as vdemo_
    from engine.vision.load import load_vision

    d = tmp_path_factory.mktemp("batch-vision")
    vdemo_.make(d)
    m = _load(d)
    m.setup_cache(CONTEXT)
    return m, load_vision(m, d), Tokenizer(d)


def _image_prompt(vis, tok, data: list[bytes], text: str) -> list[int]:
    from engine.vision import serve as vserve

    parts = [{"type": "image"} for _ in data] + [{"type": "text", "text": text}]
    ids = tok.encode(tok.render_chat([{"role": "user", "content": parts}]))
    return vserve.expand_prompt(ids, data, vis.cfg, vis.rules)


LOGPROBS = {"logprobs": 5}  # each token's log-probability and the top 5: the answer's logits, compared closely


def _cold_with_images(m, vis, ids: list[int], data: list[bytes], n: int, logprobs: list | None = None,
                      sampling: dict | None = None) -> list[int]:
    """The one-at-a-time rank's way: the model's tables rewritten for the request (engine.vision.serve.begin), the
    sampler's processing made from the prompt's ids (engine.service.rank); ``logprobs`` gets each token's
    [logprob, top 5]."""
    from engine.core.logits_processors import Processing
    from engine.vision import serve as vserve

    m.setup_cache(CONTEXT)
    runner.prepare(m, prefix_cache_bytes=0)
    keys, _ = vserve.begin(vis, {"prompt_ids": ids, "images": vserve.wire(data)}, 0)
    sampler = Sampler(0.0, 1.0, 0, processing=Processing.from_message({**LOGPROBS, **(sampling or {})}, ids))
    try:
        return runner.run(m, keys, n, sampler, set(), CHUNK,
                          on_token=lambda k, t: logprobs is not None and logprobs.append(sampler.logprobs))[0]
    finally:
        vis.end()


def _close_logprobs(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (lp, top), (lp_w, top_w) in zip(got, want):
        assert [t for t, _ in top] == [t for t, _ in top_w]
        assert abs(lp - lp_w) < 1e-4 and max(abs(a - b) for (_, a), (_, b) in zip(top, top_w)) < 1e-4


def test_a_request_with_an_image_beside_text_requests_each_answer_their_solo_tokens(vdemo):
    from engine.vision import serve as vserve
    from tests.vision_helpers import image, png

    m, vis, tok = vdemo
    pics = [png(image(100, 70, 1)), png(image(200, 130, 2))]
    img_ids = _image_prompt(vis, tok, pics, "what do you see in these two?")
    assert img_ids.count(vis.cfg.image_token_id) > CHUNK  # the images span prefill chunks
    texts = [tok.encode(tok.render_chat([{"role": "user", "content": t}])) for t in ("no picture here", "hello")]
    want_lp: list = []
    want_img = _cold_with_images(m, vis, img_ids, pics, 24, want_lp)
    want_txt = [cold(m, ids, 24) for ids in texts]
    lp = Loop(m, 3, vision=vis)
    lp.send("t0", texts[0], 24)  # a text stream running while the image prompt is prefilled and decoded
    lp.until(lambda: len(lp.tokens("t0")) >= 2)
    lp.send("img", img_ids, 24, images=vserve.wire(pics), sampling=dict(LOGPROBS))
    lp.until(lambda: lp.slot_of("img") is not None)
    lp.send("t1", texts[1], 24)  # and one admitted after it
    assert lp.answer("img")[0] == want_img
    # the multimodal rotary rows in its prefill and decode: the greedy tokens alone would not tell (plain rows
    # there move this demo's logits by about 2 % and keep the argmax)
    _close_logprobs([m_["logprobs"] for m_ in lp.sink.msgs if m_["type"] == "token" and m_["id"] == "img"], want_lp)
    assert [lp.answer(r)[0] for r in ("t0", "t1")] == want_txt
    assert m.embed_prompt is None  # the model's own hook and tables are back
    other = [png(image(100, 70, 3)), png(image(200, 130, 4))]  # the same sizes, other pixels
    assert want_img != _cold_with_images(m, vis, img_ids, other, 24)  # the images do steer the answer


def test_an_image_follow_up_reuses_its_slot_and_a_bad_image_fails_alone(vdemo):
    from engine.vision import serve as vserve
    from tests.vision_helpers import image, png

    m, vis, tok = vdemo
    pics = [png(image(120, 90, 9))]
    first_ids = _image_prompt(vis, tok, pics, "describe")
    first = _cold_with_images(m, vis, first_ids, pics, 8)
    follow = first_ids + first + tok.encode("<|end|>\n<|user|>and again<|end|>\n<|assistant|>")[1:]
    want_lp: list = []
    want = _cold_with_images(m, vis, follow, pics, 12, want_lp)
    lp = Loop(m, 2, vision=vis)
    lp.send("a", first_ids, 8, images=vserve.wire(pics))
    assert lp.answer("a")[0] == first
    runs = vis.encoder_runs
    lp.send("b", OTHER, 60)
    lp.until(lambda: len(lp.tokens("b")) >= 3)
    lp.send("bad", first_ids, 8, images=[vserve.wire([b"not an image"])[0]])
    lp.until(lambda: lp.done("bad") is not None)
    assert lp.done("bad")["type"] == "error" and "image" in lp.done("bad")["message"]
    lp.send("f", follow, 12, images=vserve.wire(pics), sampling=dict(LOGPROBS))
    got, d = lp.answer("f")
    assert lp.slot_of("b") is not None and got == want
    _close_logprobs([m_["logprobs"] for m_ in lp.sink.msgs if m_["type"] == "token" and m_["id"] == "f"], want_lp)
    assert d["cached_tokens"] == len(first_ids) + len(first) - 1 and vis.encoder_runs == runs  # no tower run


def test_an_image_prompt_with_penalties_answers_as_one_at_a_time(vdemo):
    """Penalties with images: the sampler's processing is made from the prompt's own ids, as the one-at-a-time
    rank makes it (the key ids would differ only at the image-pad id, whose logit this answer does not reach)."""
    from engine.vision import serve as vserve
    from tests.vision_helpers import image, png

    m, vis, tok = vdemo
    pics = [png(image(64, 64, 5))]
    ids = _image_prompt(vis, tok, pics, "again and again and again")
    pen = {"repetition_penalty": 1.3, "presence_penalty": 0.5}
    want = _cold_with_images(m, vis, ids, pics, 16, sampling=pen)
    assert want != _cold_with_images(m, vis, ids, pics, 16)  # the penalties change this answer
    lp = Loop(m, 2, vision=vis)
    lp.send("p", ids, 16, images=vserve.wire(pics), sampling=dict(pen))
    assert lp.answer("p")[0] == want
