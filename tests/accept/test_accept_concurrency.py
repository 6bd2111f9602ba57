"""The `concurrent_equals_solo` scenario (v100plan/accept/concurrency.py) and the served concurrency the suite reads
from /health: against a fake OpenAI-compatible server on 127.0.0.1 (real HTTP) that answers otherwise when requests
overlap, which the scenario must fail naming the first differing request, and against the bundled engine served on
CPU with --max-concurrency 2, which it must pass."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.accept_support import report, run_cli, scenario
from tests.test_service_support import service_fixture
from v100plan.accept import concurrency
from v100plan.accept.context import AcceptOptions, Target
from v100plan.accept.runner import run_acceptance


class FakeServer:
    """An OpenAI-compatible server that holds every answer for `hold_s` and says `max_concurrency` in /health; with
    `differ` a request that overlapped another answers other text than alone."""

    def __init__(self, max_concurrency: int | None, differ: bool, hold_s: float = 0.3):
        self.inflight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_a):
                pass

            def _send(self, code: int, body, content_type="application/json"):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "fake", "owned_by": "someone"}]})
                elif self.path == "/health":
                    self._send(200, {"status": "ok", "slots_busy": fake.inflight,
                                     **({"max_concurrency": max_concurrency} if max_concurrency else {})})
                else:
                    self._send(404, {"error": {"message": "no such route"}})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.inflight += 1
                    overlapped = fake.inflight > 1
                time.sleep(hold_s)
                with fake.lock:
                    overlapped = overlapped or fake.inflight > 1
                    fake.inflight -= 1
                said = json.dumps(req.get("messages") or req.get("prompt"))
                text = f"answer to {said}" + (" (seen beside another)" if differ and overlapped else "")
                chat = "messages" in req
                if req.get("stream"):
                    piece = {"delta": {"content": text}} if chat else {"text": text}
                    body = (f"data: {json.dumps({'choices': [{**piece, 'finish_reason': 'length'}]})}\n\n"
                            "data: [DONE]\n\n").encode()
                    self._send(200, body, "text/event-stream")
                    return
                choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
                self._send(200, {"object": "chat.completion" if chat else "text_completion",
                                 "choices": [{**choice, "finish_reason": "length"}],
                                 "usage": {"completion_tokens": req.get("max_tokens")}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _run(server: FakeServer) -> dict:
    result = run_acceptance(Target(endpoint=server.url), AcceptOptions(only=("concurrent_equals_solo",)))
    return next(s for s in result["scenarios"] if s["key"] == "concurrent_equals_solo")


@pytest.mark.parametrize("differ", [True, False])
def test_answers_that_change_beside_others_fail_naming_the_first_that_did(differ):
    server = FakeServer(max_concurrency=3, differ=differ)
    try:
        sc = _run(server)
    finally:
        server.close()
    assert sc["metrics"]["requests"] == 3 and sc["metrics"]["slots_busy_peak"] >= 2  # they did overlap
    if not differ:  # the same server, answering alike: passes, so the failure below is the answers' doing
        assert sc["status"] == "passed", sc
        return
    assert sc["status"] == "failed", sc
    assert sc["reason"].startswith("request 0 (completion) answered differently with 2 others than alone: the text "
                                   "differs from character"), sc["reason"]
    assert "(seen beside another)" in sc["reason"] and "3 of 3 requests differ" in sc["reason"]
    assert sc["metrics"]["differing_requests"] == [0, 1, 2]


@pytest.mark.parametrize("n, says", [(1, "decodes one request at a time"), (None, "does not say how many")])
def test_a_server_that_decodes_one_at_a_time_or_does_not_say_is_waived(n, says):
    server = FakeServer(max_concurrency=n, differ=True)
    try:
        sc = _run(server)
    finally:
        server.close()
    assert sc["status"] == "waived" and says in sc["reason"], sc


def test_the_requests_differ_in_kind_length_and_prompt():
    from v100plan.accept.context import Context

    ctx = Context(Target(endpoint="http://127.0.0.1:9"), AcceptOptions())
    ctx.model = "m"
    reqs = concurrency.requests(ctx, 4)
    assert [r.kind for r in reqs] == ["completion", "chat", "completion (streamed)", "chat (streamed)"]
    assert len({json.dumps(r.body, sort_keys=True) for r in reqs}) == 4
    assert {r.body["max_tokens"] for r in reqs} == {24, 32, 40} and all(r.body["temperature"] == 0 for r in reqs)


svc = service_fixture("--max-concurrency", "2", "--max-context", "2048")


@pytest.mark.slow
def test_the_engine_with_two_slots_answers_alike_and_the_load_uses_both(svc, tmp_path):
    out = tmp_path / "report"
    r = run_cli("accept", "--endpoint", svc.url, "--only", "concurrent_equals_solo,prefix_reuse,load",
                "--clients", "1", "--requests", "6", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = report(out)
    sc = scenario(doc, "concurrent_equals_solo")
    assert sc["status"] == "passed", sc
    assert sc["metrics"]["requests"] == 2 and sc["metrics"]["bound"] == "flag" and sc["metrics"]["differing_requests"] == []
    assert sc["metrics"]["slots_busy_peak"] == 2  # both were on the ranks together
    # each slot reuses its own prefixes (engine/service/rank_batch.py): checked, and passed, with two slots
    prefix = scenario(doc, "prefix_reuse")
    assert prefix["status"] == "passed", prefix
    # one client asked for, two slots served: the load runs two clients
    assert doc["load"]["clients"] == 2 and doc["load"]["served_max_concurrency"] == 2
    assert scenario(doc, "load")["status"] == "passed"
