"""Shared helpers for the service tests (no tests here): the demo model, TP1 references, and
a real `python -m engine serve` process on 127.0.0.1 with its real rank processes.

Everything is cached per test session: the demo model is built once, each TP1 reference
is computed once by `python -m engine generate --tp 1`.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL_ID = "v100plan-demo"
_TMP = tempfile.mkdtemp(prefix="v1p-svc-")  # short: Unix socket paths live under it
atexit.register(shutil.rmtree, _TMP, True)


def short_dir(name: str) -> str:
    path = tempfile.mkdtemp(prefix=f"{name}-", dir=_TMP)
    return path


@functools.lru_cache(maxsize=1)
def demo_model() -> str:
    """The demo model, made once per session by the engine's own generator."""
    out = os.path.join(_TMP, "demo")
    subprocess.run([sys.executable, "-m", "engine", "make-demo-model", out], cwd=REPO, check=True,
                   capture_output=True, timeout=120)
    return out


@functools.lru_cache(maxsize=1)
def tokenizer():
    from engine.core.tokenizer import Tokenizer

    return Tokenizer(demo_model())


def prompt_ids(text: str) -> list[int]:
    return tokenizer().encode(text)


def chat_prompt_ids(messages: list[dict]) -> list[int]:
    return tokenizer().encode(tokenizer().render_chat(messages))


@functools.lru_cache(maxsize=64)
def tp1_reference(ids: tuple[int, ...], max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                  model: str | None = None, device: str | None = None, dtype: str | None = None) -> dict:
    """`python -m engine generate --tp 1` on the same token ids: {"token_ids": [...], "text": ...}."""
    cmd = [sys.executable, "-m", "engine", "generate", "--model", model or demo_model(), "--tp", "1",
           "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", str(max_tokens), "--json"]
    if temperature:
        cmd += ["--temperature", str(temperature), "--seed", str(seed)]
    if device:
        cmd += ["--device", device]
    if dtype:
        cmd += ["--dtype", dtype]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def reference_until_eos(ref_ids: list[int], eos: tuple[int, ...] = (2, 7)) -> list[int]:
    """What the service must return for a reference run: the tokens up to and including the first EOS."""
    for i, t in enumerate(ref_ids):
        if t in eos:
            return ref_ids[: i + 1]
    return ref_ids


def expected_tokens(ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> list[int]:
    """The token ids the service must answer for these prompt ids: the TP1 reference up to its first EOS."""
    return reference_until_eos(tp1_reference(tuple(ids), max_tokens, temperature, seed)["token_ids"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1][:1] != "Z"
    except FileNotFoundError:
        return False


def wait_until(predicate, timeout_s: float, step_s: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def service_fixture(*extra: str, model=None, **kw):
    """A module-scoped fixture: one `python -m engine serve` (ServiceProcess's arguments; `model` may
    be a function, called when the fixture starts) shared by the module's tests, healthy before the
    first and stopped after the last. In a test module: `svc = service_fixture("--queue-cap", "1", ...)`."""

    @pytest.fixture(scope="module")
    def svc():
        s = ServiceProcess(*extra, model=model() if callable(model) else model, **kw)
        try:
            s.wait_healthy()
            yield s
        finally:
            s.stop()

    return svc


class ServiceProcess:
    """`python -m engine serve` as a child of the test, with helpers to talk to it."""

    def __init__(self, *extra: str, model: str | None = None, api_key: str | None = None,
                 stall_timeout_s: float = 5.0, allreduce_timeout_s: float = 3.0, stderr=subprocess.STDOUT):
        self.port = free_port()
        self.state_dir = short_dir("state")
        if api_key is None and "--enable-fault-injection" in extra:
            api_key = "sk-test-" + os.urandom(8).hex()  # serve refuses fault injection without a key
        self.api_key = api_key
        self.log_path = os.path.join(self.state_dir, "serve.log")
        cmd = [sys.executable, "-m", "engine", "serve", "--model", model or demo_model(), "--tp", "2",
               "--port", str(self.port), "--state-dir", self.state_dir,
               "--stall-timeout-s", str(stall_timeout_s), "--allreduce-timeout-s", str(allreduce_timeout_s),
               "--start-timeout-s", "120", *extra]
        if api_key is not None:
            key_file = os.path.join(self.state_dir, "key")
            Path(key_file).write_text(api_key + "\n")
            os.chmod(key_file, 0o600)  # serve refuses a key file others can read
            cmd += ["--api-key-file", key_file]
        self.cmd = cmd
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=stderr,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=60,
                                   headers={"Authorization": f"Bearer {api_key}"} if api_key else {})

    def health(self) -> httpx.Response | None:
        try:
            return self.client.get("/health", timeout=5)
        except httpx.TransportError:
            return None

    def wait_healthy(self, timeout_s: float = 120.0, newer_than: int | None = None) -> dict:
        def ok():
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            r = self.health()
            if r is None or r.status_code != 200:
                return None
            body = r.json()
            return body if newer_than is None or body["generation"] > newer_than else None

        return wait_until(ok, timeout_s, 0.1, "a healthy service")

    def complete(self, ids: list[int] | str, max_tokens: int, **kw) -> httpx.Response:
        return self.client.post("/v1/completions", json={"model": kw.pop("model", MODEL_ID), "prompt": ids,
                                                         "max_tokens": max_tokens, "temperature": 0.0, **kw})

    def targets(self) -> dict:
        return self.client.get("/control/targets").json()

    def inject(self, action: str, rank: int | None = None, at_step: int | None = None) -> dict:
        r = self.client.post("/control/inject", json={"action": action, "rank": rank, "at_step": at_step})
        assert r.status_code == 200, r.text
        return r.json()

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return Path(self.log_path).read_text(errors="replace")

    def events(self, kind: str | None = None) -> list[dict]:
        out = []
        for line in self.log_text().splitlines():
            if line.startswith("{"):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if kind is None or rec.get("event") == kind:
                    out.append(rec)
        return out

    def metric(self, name: str, labels: str = "") -> float:
        text = self.client.get("/metrics").text
        for line in text.splitlines():
            if line.startswith(name + labels + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> None:
        pids = []
        r = self.health()
        if r is not None:
            pids = r.json().get("rank_pids") or []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.client.close()
        self._log.close()
        for pid in pids:  # the ranks must not outlive serve
            wait_until(lambda p=pid: not pid_alive(p), 10, what=f"rank pid {pid} to exit")
        shutil.rmtree(self.state_dir, ignore_errors=True)


def stream_until_fault(svc, payload: dict, inject, after_chunks: int = 2) -> tuple[str, list[dict]]:
    """Stream, inject after a few chunks, return (text received, the data events after it)."""
    text, tail, injected = "", [], False
    with svc.client.stream("POST", "/v1/completions", json={**payload, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                tail.append({"done": True})
                break
            event = json.loads(line[6:])
            if "error" in event:
                tail.append(event)
                continue
            text += event["choices"][0]["text"]
            chunks += 1
            if chunks == after_chunks and not injected:
                inject()
                injected = True
    return text, tail


# ----- raw HTTP/1.1 on a socket (what no client library would send) ---------------------------------


def raw_request(svc, data: bytes, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", svc.port), timeout=timeout)
    if data:
        s.sendall(data)
    return s


def keyed_idle(svc, key: str) -> socket.socket:
    """A kept-alive connection that showed the API key (one request answered), idle now."""
    s = raw_request(svc, f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
    data = b""
    while not (b"\r\n\r\n" in data and data.rstrip().endswith(b"}")):
        data += s.recv(65536)
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    s.close()
    return out
