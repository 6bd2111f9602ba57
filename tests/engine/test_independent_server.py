"""The independent server (`transformers serve`, tests/independent_server.py) really answers.

Every greedy answer is checked against `python -m engine generate --tp 1` on the same token ids:
two makes, one model, the same tokens. A stub, a wrong tokenization (BOS, chat template) or a
server that ignores max_tokens fails here. test_documented_gaps shows each entry of LACKS, the
list an acceptance run uses to tell "this make cannot" from "this make is broken".
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from tests import independent_server as ind
from tests.test_service_support import pid_alive

independent_server = ind.independent_server

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


@functools.lru_cache(maxsize=1)
def _tokenizer(model_dir: str):
    from engine.core.tokenizer import Tokenizer

    return Tokenizer(model_dir)


def _reference(model_dir: str, out: list[int]) -> dict:
    """The engine's greedy tokens, cut at the first EOS as an OpenAI server stops there."""
    tok = _tokenizer(model_dir)
    for i, t in enumerate(out):
        if t in tok.eos_ids:
            return {"text": tok.decode(out[:i]), "completion_tokens": i + 1, "finish_reason": "stop"}
    return {"text": tok.decode(out), "completion_tokens": len(out), "finish_reason": "length"}


@pytest.fixture(scope="module")
def engine_reference(independent_server) -> dict[str, dict]:
    """This project's engine (`python -m engine generate --tp 1`, greedy) on the same token ids as the
    server sees: "completion" for PROMPT (12 tokens), "chat" for MESSAGES (10 tokens); both run at once."""
    s = independent_server
    jobs = {"completion": (prompt_ids(s, PROMPT), 12), "chat": (chat_ids(s, MESSAGES), 10)}
    procs = {name: subprocess.Popen([sys.executable, "-m", "engine", "generate", "--model", s.model, "--tp", "1",
                                     "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", str(n), "--json"],
                                    cwd=ind.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
             for name, (ids, n) in jobs.items()}
    refs = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-2000:]
            refs[name] = _reference(s.model, json.loads(out.strip().splitlines()[-1])["token_ids"])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return refs


def prompt_ids(server, text: str) -> tuple[int, ...]:
    return tuple(_tokenizer(server.model).encode(text))


def chat_ids(server, messages: list[dict]) -> tuple[int, ...]:
    tok = _tokenizer(server.model)
    return tuple(tok.encode(tok.render_chat(messages)))


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


def sse_events(server, path: str, body: dict) -> list[str]:
    """The `data:` payloads of one streamed response, in order, until the server closes the stream."""
    events = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line[len("data:"):].strip())
    return events


def test_identity(independent_server):
    s = independent_server
    assert s.url.startswith("http://127.0.0.1:")
    assert s.make.startswith("transformers-serve 5.")
    assert s.api_key is None and "api_key" in s.lacks
    models = httpx.get(s.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [s.model]
    # transformers serve, not this project's engine, is what listens
    cmdline = open(f"/proc/{s.pid}/cmdline", "rb").read().split(b"\0")
    assert b"transformers.cli.transformers" in cmdline and b"serve" in cmdline
    assert b"engine" not in cmdline


def test_completion_matches_engine(independent_server, engine_reference):
    s = independent_server
    ids = prompt_ids(s, PROMPT)
    r = post(s, "/v1/completions", {"model": s.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == s.model
    (choice,) = body["choices"]
    ref = engine_reference["completion"]
    assert choice["text"] == ref["text"]
    assert choice["finish_reason"] == ref["finish_reason"]
    assert body["usage"]["prompt_tokens"] == len(ids)  # same tokenization, BOS included
    assert body["usage"]["completion_tokens"] == ref["completion_tokens"]


def test_chat_completion_matches_engine(independent_server, engine_reference):
    s = independent_server
    ids = chat_ids(s, MESSAGES)
    r = post(s, "/v1/chat/completions", {"model": s.model, "messages": MESSAGES, "max_tokens": 10,
                                         "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    ref = engine_reference["chat"]
    assert choice["message"]["content"] == ref["text"]
    assert choice["finish_reason"] == ref["finish_reason"]
    assert body["usage"]["prompt_tokens"] == len(ids)  # same chat template, same BOS


def test_streamed_completion(independent_server, engine_reference):
    s = independent_server
    events = sse_events(s, "/v1/completions", {"model": s.model, "prompt": PROMPT, "max_tokens": 12,
                                               "stream_options": {"include_usage": True}})
    chunks = [json.loads(e) for e in events]  # every event is JSON: no [DONE] from this make (LACKS)
    # as OpenAI streams: the usage comes on request (stream_options.include_usage), in a last chunk of no choices
    *pieces, usage = chunks
    assert usage["choices"] == [] and "usage" not in pieces[-1]
    texts = [c["choices"][0]["text"] for c in pieces]
    assert sum(1 for t in texts if t) >= 3, events  # streamed piece by piece, not in one block
    assert all(c["choices"][0].get("finish_reason") is None for c in pieces[:-1])
    ref = engine_reference["completion"]
    assert "".join(texts) == ref["text"]
    assert pieces[-1]["choices"][0]["finish_reason"] == ref["finish_reason"]
    assert usage["usage"]["completion_tokens"] == ref["completion_tokens"]
    assert len({c["id"] for c in chunks}) == 1
    plain = [json.loads(e) for e in sse_events(s, "/v1/completions", {"model": s.model, "prompt": PROMPT,
                                                                       "max_tokens": 12})]
    assert all("usage" not in c for c in plain)  # and not without it


def test_streamed_chat_completion(independent_server, engine_reference):
    s = independent_server
    events = sse_events(s, "/v1/chat/completions", {"model": s.model, "messages": MESSAGES, "max_tokens": 10})
    chunks = [json.loads(e) for e in events]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    content = [c["choices"][0]["delta"].get("content") or "" for c in chunks]
    assert sum(1 for t in content if t) >= 3, events
    ref = engine_reference["chat"]
    assert "".join(content) == ref["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == ref["finish_reason"]


def test_supported_parameters(independent_server):
    """What an acceptance run may rely on with this make: max_tokens -> "length", stop -> "stop",
    model left out or named, seeded sampling (through generation_config), concurrent requests."""
    s = independent_server
    full = post(s, "/v1/completions", {"model": s.model, "prompt": PROMPT, "max_tokens": 12}).json()
    text = full["choices"][0]["text"]
    short = post(s, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3}).json()  # model is optional
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 3
    assert text.startswith(short["choices"][0]["text"])

    stop = text[len(text) // 2]  # a character the greedy answer reaches halfway
    r = post(s, "/v1/completions", {"model": s.model, "prompt": PROMPT, "max_tokens": 12, "stop": [stop]}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    cut = r["choices"][0]["text"]
    assert text.startswith(cut) and len(cut) < len(text) and stop in cut

    assert post(s, "/v1/completions", {"model": "someone-else", "prompt": PROMPT}).status_code == 400

    sampled = {"model": s.model, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0,
               "generation_config": json.dumps({"do_sample": True, "temperature": 1.0})}
    a, b, c = (post(s, "/v1/completions", {**sampled, "seed": seed}).json()["choices"][0]["text"]
               for seed in (11, 11, 12))
    assert a == b != c

    with httpx.Client(base_url=s.url, timeout=120) as client:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(lambda _: client.post("/v1/completions", json={"model": s.model, "prompt": PROMPT,
                                                                            "max_tokens": 12}), range(4)))
    assert [x.status_code for x in rs] == [200] * 4
    assert {x.json()["choices"][0]["text"] for x in rs} == {text}


def test_documented_gaps(independent_server):
    """Each LACKS entry, shown; when a transformers release closes one, this fails and LACKS is updated."""
    s = independent_server
    shown = set()

    r = post(s, "/v1/completions", {"model": s.model, "prompt": PROMPT, "max_tokens": 2},
             headers={"Authorization": "Bearer not-a-key"})
    assert r.status_code == 200
    shown.add("api_key")

    events = sse_events(s, "/v1/completions", {"model": s.model, "prompt": PROMPT, "max_tokens": 4})
    assert "[DONE]" not in events and json.loads(events[-1])["choices"][0]["finish_reason"]
    shown.add("done_marker")

    cfg = json.loads((s.model_dir / "config.json").read_text())
    long_prompt = "ab " * (cfg["max_position_embeddings"] // 2 + 50)  # about 2 tokens per "ab "
    r = post(s, "/v1/completions", {"model": s.model, "prompt": long_prompt, "max_tokens": 1})
    # closed in transformers 5.25 (5.24 answered it 200, running the model past its positions): refused now
    assert r.status_code == 400 and "at most" in r.text

    text = post(s, "/v1/completions", {"model": s.model, "prompt": PROMPT, "max_tokens": 12}).json()["choices"][0]["text"]
    stop = text[len(text) // 2]
    r = post(s, "/v1/completions", {"model": s.model, "prompt": PROMPT, "max_tokens": 12, "stop": [stop]}).json()
    assert stop in r["choices"][0]["text"]  # OpenAI's text would end just before the stop string
    shown.add("stop_excluded")

    plain = {"model": s.model, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0}
    outs = {post(s, "/v1/completions", {**plain, "seed": seed}).json()["choices"][0]["text"] for seed in (1, 2, 3)}
    assert outs == {post(s, "/v1/completions", {**plain, "max_tokens": 16}).json()["choices"][0]["text"]}
    shown.add("temperature_sampling")

    r = post(s, "/v1/completions", {"model": s.model, "prompt": list(prompt_ids(s, PROMPT)), "max_tokens": 2})
    assert r.status_code == 400
    shown.add("token_id_prompt")

    r = post(s, "/v1/completions", {"model": s.model, "prompt": PROMPT, "max_tokens": 2, "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    shown.add("n")

    for bad in (0, -1):  # closed in 5.25 (5.24 answered both with a 500): refused as OpenAI refuses them
        assert post(s, "/v1/completions", {"model": s.model, "prompt": PROMPT, "max_tokens": bad}).status_code == 400

    for extra in ({"no_such_field": 1}, {"ignore_eos": True}):  # vLLM's extensions included
        r = post(s, "/v1/completions", {"model": s.model, "prompt": PROMPT, "max_tokens": 2, **extra})
        assert r.status_code == 422 and next(iter(extra)) in r.json()["detail"]
    shown.add("unknown_field_400")

    r = post(s, "/v1/completions", {"model": "someone-else", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 400 and "error" not in r.json() and "pinned" in r.json()["detail"]
    shown.add("error_object")

    assert shown == set(ind.LACKS)


def test_stop_ends_the_whole_process_group(tmp_path):
    """What the fixture's teardown does to the server: the process and every child it started end."""
    pids = tmp_path / "pids"
    proc = subprocess.Popen(["sh", "-c", f"sleep 300 & echo $! > {pids}; exec sleep 300"], start_new_session=True)
    deadline = time.monotonic() + 10
    while not (pids.exists() and pids.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pids.read_text())
    ind._stop(proc)
    assert proc.returncode is not None
    deadline = time.monotonic() + 10
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child)
