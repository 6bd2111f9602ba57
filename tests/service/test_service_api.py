"""The service's API against real rank processes on 127.0.0.1: answers equal to the TP1
reference, streaming, the official openai client, validation, auth, limits, queue cap,
and client disconnects cancelling both ranks. One service for the whole module."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from tests.test_service_support import (
    MODEL_ID,
    chat_prompt_ids,
    expected_tokens,
    prompt_ids,
    reference_until_eos,
    service_fixture,
    tp1_reference,
    wait_until,
)

pytestmark = pytest.mark.slow

KEY = "test-key-5f0c"
MAX_CONTEXT = 2048
# A request that cannot finish before its client leaves, however fast the machine decodes:
# all the context there is, past end-of-sequence ("ignore_eos"; greedy "Long story" meets EOS
# after ~90 tokens, and the demo model decodes ~1 ms per token on a quiet CPU).
LONG_TOKENS = MAX_CONTEXT - 32


# Generous timeouts: nothing here is a fault, and CI's two shared cores can be slow.
svc = service_fixture("--queue-cap", "1", "--max-context", str(MAX_CONTEXT), "--body-limit-bytes", "65536",
                      api_key=KEY, stall_timeout_s=60, allreduce_timeout_s=30)


@pytest.fixture(scope="module")
def client(svc):
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_health_metrics_and_models(svc, client):
    h = svc.client.get("/health")
    assert h.status_code == 200
    body = h.json()
    assert body["status"] == "ok" and body["selftest"] == "passed" and len(body["rank_pids"]) == 2
    assert body["allreduce"] in ("gloo", "host_mailbox")
    assert body["max_concurrency"] == 1 and body["slots_busy"] == 0  # the default: one request at a time
    metrics = svc.client.get("/metrics").text
    assert "v100plan_ranks_up 1" in metrics
    assert f'v100plan_allreduce_path{{path="{body["allreduce"]}"}} 1' in metrics
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID


def test_completion_equals_tp1_reference(svc):
    ids = prompt_ids("The quick brown fox")
    r = svc.complete("The quick brown fox", 24)
    assert r.status_code == 200, r.text
    body = r.json()
    expected = expected_tokens(ids, 24)
    assert body["v100plan"]["token_ids"] == expected
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == len(expected)
    assert body["choices"][0]["finish_reason"] == ("length" if len(expected) == 24 else "stop")
    # Token ids as the prompt are used verbatim (no BOS added), as with `generate --prompt-ids`.
    raw = [40, 41, 42, 43, 44]
    r2 = svc.complete(raw, 10)
    assert r2.json()["v100plan"]["token_ids"] == expected_tokens(raw, 10)


def test_openai_client_chat_and_streams(svc, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    expected_ids = expected_tokens(chat_prompt_ids(messages), 20)
    chat = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20, temperature=0)
    assert chat.model_extra["v100plan"]["token_ids"] == expected_ids
    full_text = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant"

    pieces, reasons = [], []
    for chunk in client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20, temperature=0,
                                                stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == full_text
    assert reasons[-1] == chat.choices[0].finish_reason and all(r is None for r in reasons[:-1])

    text = client.completions.create(model=MODEL_ID, prompt="Once upon", max_tokens=16, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_ID, prompt="Once upon", max_tokens=16, temperature=0, stream=True))
    assert streamed == text.choices[0].text
    assert text.model_extra["v100plan"]["token_ids"] == expected_tokens(prompt_ids("Once upon"), 16)


def test_sse_wire_format_ends_with_done(svc):
    with svc.client.stream("POST", "/v1/completions", json={"model": MODEL_ID, "prompt": "Hi", "max_tokens": 5,
                                                           "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    last = json.loads(lines[-2][6:])
    assert last["choices"][0]["finish_reason"] in ("length", "stop") and "usage" in last


def test_max_tokens_truncates_and_stop_string_ends(svc):
    ids = prompt_ids("The quick brown fox")
    ref = tp1_reference(tuple(ids), 24)
    expected = reference_until_eos(ref["token_ids"])
    short = svc.complete("The quick brown fox", 3).json()
    assert short["v100plan"]["token_ids"] == expected[:3] and short["choices"][0]["finish_reason"] == "length"
    full_text = svc.complete("The quick brown fox", 24).json()["choices"][0]["text"]
    stop = full_text[6:9]
    assert len(stop) == 3 and stop in full_text
    cut = full_text[: full_text.index(stop)]
    r = svc.complete("The quick brown fox", 24, stop=[stop]).json()
    assert r["choices"][0]["text"] == cut and r["choices"][0]["finish_reason"] == "stop"
    with svc.client.stream("POST", "/v1/completions", json={"model": MODEL_ID, "prompt": "The quick brown fox",
                                                           "max_tokens": 24, "temperature": 0, "stop": stop,
                                                           "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_seeds_same_on_both_ranks_and_fresh_per_request(svc):
    ids = prompt_ids("Random words:")
    a = svc.complete(ids, 16, temperature=0.9, seed=1234).json()["v100plan"]
    b = svc.complete(ids, 16, temperature=0.9, seed=1234).json()["v100plan"]
    assert a["token_ids"] == b["token_ids"] and a["seed"] == 1234
    # Same distribution, same seed: the sampled tokens equal one process sampling alone.
    assert a["token_ids"] == expected_tokens(ids, 16, 0.9, 1234)
    drawn = [svc.complete(ids, 4, temperature=0.9).json()["v100plan"]["seed"] for _ in range(3)]
    assert len(set(drawn)) == 3
    # The request's log line is written as its answer goes out, not necessarily before the client reads it.
    wait_until(lambda: set(drawn) <= {e.get("seed") for e in svc.events("request") if e.get("id")}, 10,
               what=f"the drawn seeds {drawn} in the service log")


@pytest.mark.parametrize("payload, status, param", [
    ({"model": MODEL_ID, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL_ID, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL_ID, "prompt": "x", "temperature": 3.5}, 400, "temperature"),
    ({"model": MODEL_ID, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x"}, 400, "model"),
    ({"model": MODEL_ID, "prompt": "x", "n": 2}, 400, "n"),
    ({"model": "gpt-4o", "prompt": "x"}, 404, "model"),
])
def test_bad_requests_name_the_field(svc, payload, status, param):
    r = svc.client.post("/v1/completions", json=payload)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] if status != 404 else err["param"] == param


def test_bad_json_context_overflow_and_body_limit(svc):
    r = svc.client.post("/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    ids = prompt_ids("a" * 40)
    r = svc.complete("a" * 40, MAX_CONTEXT)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert f"{len(ids)} tokens" in msg and f"context limit of {MAX_CONTEXT}" in msg
    r = svc.client.post("/v1/completions", json={"model": MODEL_ID, "prompt": "x" * 70000, "max_tokens": 1})
    assert r.status_code == 413
    r = svc.client.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_api_key_checked(svc):
    anon = httpx.Client(base_url=svc.url, timeout=30)
    try:
        assert anon.get("/v1/models").status_code == 401
        r = anon.post("/v1/completions", json={"model": MODEL_ID, "prompt": "x"},
                      headers={"Authorization": "Bearer wrong-key"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        # Health stays open for supervisors, but says only its status without the key; metrics need it.
        h = anon.get("/health")
        assert h.status_code == 200 and h.json() == {"status": "ok"}
        assert anon.get("/metrics").status_code == 401
    finally:
        anon.close()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=svc.url + "/v1", api_key="nope", max_retries=0).models.list()


def _cancelled_line(svc, request_id_before: set, timeout_s: float = 20) -> dict:
    def find():
        for e in svc.events("request"):
            if e.get("id") and e["id"] not in request_id_before and e.get("outcome") == "client_gone":
                if e.get("rank_finish") == ["cancelled", "cancelled"]:
                    return e
        return None

    return wait_until(find, timeout_s, what="a request line with both ranks cancelled")


def _request_ids(svc) -> set:
    return {e.get("id") for e in svc.events("request")}


def test_stream_disconnect_cancels_both_ranks(svc):
    before = _request_ids(svc)
    cancelled_before = svc.metric("v100plan_cancelled_total")
    with svc.client.stream("POST", "/v1/completions", json={"model": MODEL_ID, "prompt": "Long story",
                                                           "max_tokens": LONG_TOKENS, "temperature": 0,
                                                           "ignore_eos": True, "stream": True}) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    break  # leaving the block closes the connection mid-stream
    line = _cancelled_line(svc, before)
    assert line["completion_tokens"] < LONG_TOKENS
    wait_until(lambda: svc.metric("v100plan_cancelled_total") > cancelled_before, 10, what="cancel counted")
    # Both ranks stopped on the same step and are in step: the next answer is still exact.
    ids = prompt_ids("The quick brown fox")
    assert svc.complete(ids, 12).json()["v100plan"]["token_ids"] == expected_tokens(ids, 12)


def test_non_streaming_disconnect_cancels_both_ranks(svc):
    before = _request_ids(svc)
    with pytest.raises(httpx.ReadTimeout):
        svc.client.post("/v1/completions", json={"model": MODEL_ID, "prompt": "Long story", "max_tokens": LONG_TOKENS,
                                                 "temperature": 0, "ignore_eos": True}, timeout=0.5)
    line = _cancelled_line(svc, before)
    assert line["completion_tokens"] < LONG_TOKENS
    ids = prompt_ids("Once upon")
    assert svc.complete(ids, 8).json()["v100plan"]["token_ids"] == expected_tokens(ids, 8)


def test_disconnect_during_prefill_cancels_both_ranks(svc):
    # About 1800 prompt tokens: 8 prefill chunks, most of a second on CPU; the client leaves after 0.15 s.
    before = _request_ids(svc)
    with pytest.raises(httpx.ReadTimeout):
        svc.client.post("/v1/completions", json={"model": MODEL_ID, "prompt": "word " * 600, "max_tokens": 50,
                                                 "temperature": 0}, timeout=0.15)
    line = _cancelled_line(svc, before)
    # The proxy sees the hang-up on its next look at the connection: on a fast machine the prefill may
    # be over by then and a token or two sampled, never the request's 50.
    assert line["prompt_tokens"] > 1500 and line["completion_tokens"] < 50
    ids = prompt_ids("Once upon")
    assert svc.complete(ids, 8).json()["v100plan"]["token_ids"] == expected_tokens(ids, 8)


def test_queue_cap_answers_429_with_retry_after(svc):
    # --queue-cap 1: one running, one waiting, the third is refused. The long requests ask for
    # all the context there is, so they are still running when the third arrives however fast
    # the machine decodes; their clients give up after 1.5 s (or, on a very fast machine, finish).
    long = {"model": MODEL_ID, "prompt": "Long story", "max_tokens": LONG_TOKENS, "temperature": 0,
            "ignore_eos": True}
    results = {}

    def call(name):
        try:
            results[name] = svc.client.post("/v1/completions", json=long, timeout=1.5).status_code
        except httpx.ReadTimeout:
            results[name] = "timeout"

    first = threading.Thread(target=call, args=("first",))
    first.start()
    wait_until(lambda: svc.metric("v100plan_requests_running") == 1, 5, what="the first request to run")
    second = threading.Thread(target=call, args=("second",))
    second.start()
    wait_until(lambda: svc.metric("v100plan_queue_depth") == 1, 5, what="the second request to wait")
    r = svc.client.post("/v1/completions", json=long)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert "queue-cap 1" in r.json()["error"]["message"]
    first.join()
    second.join()
    assert set(results) == {"first", "second"}
    assert set(results.values()) <= {200, "timeout"}, results
    # Both left; the service drains them (cancel on both ranks) and serves again. The proxy sees a
    # client's disconnect on its next event-loop turn: wait for the waiting one to be withdrawn.
    wait_until(lambda: svc.metric("v100plan_queue_depth") == 0, 10, what="the waiting request to be withdrawn")
    ids = prompt_ids("Once upon")
    got = svc.complete(ids, 8)
    assert got.status_code == 200, got.text
    assert got.json()["v100plan"]["token_ids"] == expected_tokens(ids, 8)
    assert not svc.events("rank_failure")  # nothing in this module may cost a restart


def test_ignore_eos_generates_exactly_max_tokens_like_tp1(svc):
    # Greedy "Long story" reaches end-of-sequence early; with ignore_eos the answer runs on to
    # max_tokens and equals TP1's exactly-N tokens (generate without --stop-at-eos).
    ids = prompt_ids("Long story")
    ref = tp1_reference(tuple(ids), 120)["token_ids"]
    plain = svc.complete(ids, 120).json()
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] < 120
    full = svc.complete(ids, 120, ignore_eos=True).json()
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["v100plan"]["token_ids"] == ref
    r = svc.complete(ids, 4, ignore_eos="yes")
    assert r.status_code == 400 and "ignore_eos" in r.text
