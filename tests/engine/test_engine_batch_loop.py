"""The rank's batch loop (engine/service/rank_batch.py, `serve --max-concurrency N`) driven round by round in one
process (TP1; the served TP2 pair is tests/service/test_service_concurrency.py): prefix reuse per slot while other
slots run, the answers equal to what the one-sequence runner answers cold (greedy, float32)."""

from __future__ import annotations

import queue

import pytest

from engine.core import config as ecfg
from engine.core import demo, runner, weights
from engine.core.model import Model
from engine.core.sampling import Sampler
from engine.service import protocol
from engine.service.rank_batch import BatchLoop

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


def cold(m: Model, ids: list[int], n: int = ANSWER, spec_tokens: int = 0) -> list[int]:
    """The one-sequence runner's greedy answer from nothing (one slot, no prefix cache)."""
    m.setup_cache(CONTEXT)
    runner.prepare(m, prefix_cache_bytes=0, spec_tokens=spec_tokens)
    out, _ = runner.run(m, ids, n, Sampler(0.0, 1.0, 0), set(), CHUNK, spec_tokens=spec_tokens)
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
