"""Issue 46, what a local user without the key can still reach: keyless sockets cannot starve key holders
(the connection cap closes idle keyless connections to make room, never a keyed one), a body cut short by a
half-close is answered 400, the OpenAPI schema needs the key, and no rank keeps a TCP port open after its
start (gloo's listener takes anyone's connection)."""

from __future__ import annotations

import json
import os
import socket
import time

import httpx
import pytest

from tests.test_service_support import raw_request, read_all, service_fixture

pytestmark = pytest.mark.slow

KEY = "sk-exposure-77a1"
svc = service_fixture(api_key=KEY)  # the default cap: 256 connections

KEYLESS = 300


def _response(s: socket.socket) -> bytes:
    """One whole response on a kept-alive connection (Content-Length framed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(v for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n")[1:])
                      if k.strip().lower() == b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def _keyed_get(s: socket.socket, path: str = "/v1/models") -> bytes:
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    return _response(s)


def test_300_idle_keyless_sockets_do_not_stop_a_keyed_client(svc):
    before = svc.metric("v100plan_connections_evicted_total")
    kept = raw_request(svc, b"")
    assert _keyed_get(kept).startswith(b"HTTP/1.1 200")  # a key holder's kept-alive connection, idle now
    keyless = []
    for i in range(KEYLESS):  # half send half a request's headers (slowloris), half send nothing at all
        keyless.append(raw_request(svc, b"GET /health HTTP/1.1\r\nHost: x\r\n" if i % 2 else b""))
    try:
        t0 = time.monotonic()
        r = httpx.get(f"{svc.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert r.status_code == 200, r.text
        assert _keyed_get(kept).startswith(b"HTTP/1.1 200")  # never closed to make room: it showed the key
        took = time.monotonic() - t0
        # the oldest keyless ones made room: the service closed them (a FIN, or a reset where the kernel still
        # held bytes the service had not read), counted until the count is reached or 10 s pass (a busy
        # machine delivers the closes late)
        gone: set[int] = set()
        deadline = time.monotonic() + 10
        while len(gone) < KEYLESS + 2 - 256 - 1 and time.monotonic() < deadline:
            for i, s in enumerate(keyless):
                if i in gone:
                    continue
                s.settimeout(0.001)
                try:
                    if s.recv(1) == b"":
                        gone.add(i)
                except ConnectionResetError:
                    gone.add(i)
                except socket.timeout:
                    pass
        closed = len(gone)
        assert closed >= KEYLESS + 2 - 256 - 1, closed
        assert svc.metric("v100plan_connections_evicted_total") >= before + closed
        print(f"\n{KEYLESS} keyless sockets open: the keyed request answered in {took * 1000:.0f} ms; "
              f"{closed} keyless connections closed to make room")
    finally:
        kept.close()
        for s in keyless:
            s.close()


def test_a_body_shorter_than_its_content_length_then_a_half_close_gets_400(svc):
    s = raw_request(svc, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n{\"model\":")
    s.shutdown(socket.SHUT_WR)
    reply = read_all(s)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), reply[:300]
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and "before the request was complete" in err["message"]
    # half-closed in the middle of the headers: 400 too
    s = raw_request(svc, b"GET /health HTTP/1.1\r\nHost: x\r\n")
    s.shutdown(socket.SHUT_WR)
    assert read_all(s).startswith(b"HTTP/1.1 400")


def test_the_openapi_schema_needs_the_key_and_there_are_no_docs_pages(svc):
    r = httpx.get(f"{svc.url}/openapi.json", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert "paths" not in r.text
    assert "/v1/completions" in svc.client.get("/openapi.json").json()["paths"]
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert httpx.get(f"{svc.url}{path}", timeout=10).status_code == 404
        assert svc.client.get(path).status_code == 404


def _listening_tcp_inodes() -> set[str]:
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                found.add(fields[9])
        found.discard("0")
    return found


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def test_no_rank_keeps_a_tcp_port_open_once_started(svc):
    health = svc.wait_healthy()
    assert health["allreduce"] == "host_mailbox", health["allreduce"]  # the CPU path this test is about
    listening = _listening_tcp_inodes()
    for pid in health["rank_pids"]:
        open_ports = _socket_inodes(pid) & listening
        assert not open_ports, f"rank pid {pid} listens on TCP (socket inodes {sorted(open_ports)})"
    r = svc.complete([1, 2, 3], 4)  # the pair still serves, on its mailbox
    assert r.status_code == 200, r.text
