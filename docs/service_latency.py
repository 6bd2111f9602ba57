"""Reused- vs new-connection latency of a minimal ASGI app served by uvicorn from a pre-bound socket,
with the listening socket made the old way (socket.create_server: proto 0, so asyncio leaves Nagle on)
and the new way (engine.service.serve.listen_socket: IPPROTO_TCP + TCP_NODELAY). With --url, the same
measurement against a running service (GET /v1/models, --key for the Bearer key).

    .venv/bin/python docs/service_latency.py            # both sockets, minimal app
    .venv/bin/python docs/service_latency.py --url http://127.0.0.1:8000 --key KEY

Prints one JSON line per case: median and p90 in ms over --n requests.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b'{"object":"list","data":[]}'
    # Headers and body in two writes, as every uvicorn response: the second waits behind Nagle.
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _measure(url: str, n: int, headers: dict) -> dict:
    reused, fresh = [], []
    with httpx.Client(headers=headers) as c:
        c.get(url)
        for _ in range(n):
            t0 = time.perf_counter()
            c.get(url)
            reused.append(time.perf_counter() - t0)
    for _ in range(n):
        with httpx.Client(headers=headers) as c:
            t0 = time.perf_counter()
            c.get(url)
            fresh.append(time.perf_counter() - t0)

    def stats(xs):
        xs = sorted(xs)
        return {"median_ms": round(statistics.median(xs) * 1000, 2), "p90_ms": round(xs[int(0.9 * len(xs))] * 1000, 2)}

    return {"reused": stats(reused), "new": stats(fresh)}


def _serve(sock: socket.socket) -> tuple:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(_app, log_level="warning", lifespan="off", loop="asyncio"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)
    return server, t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url")
    p.add_argument("--key")
    p.add_argument("--n", type=int, default=50)
    a = p.parse_args()
    if a.url:
        headers = {"Authorization": f"Bearer {a.key}"} if a.key else {}
        print(json.dumps({"case": "service", "url": a.url, **_measure(a.url + "/v1/models", a.n, headers)}))
        return
    from engine.service.serve import listen_socket

    for name, make in (("socket.create_server (before)", lambda: socket.create_server(("127.0.0.1", 0))),
                       ("engine.service.serve.listen_socket (after)", lambda: listen_socket("127.0.0.1", 0))):
        sock = make()
        port = sock.getsockname()[1]
        server, t = _serve(sock)
        print(json.dumps({"case": name, **_measure(f"http://127.0.0.1:{port}/", a.n, {})}))
        server.should_exit = True
        t.join(5)


if __name__ == "__main__":
    main()
