"""The rank <-> client protocol: newline-delimited JSON over a Unix socket (stdlib only).

A rank (``python -m engine rank``) listens on its control socket, accepts one
client (the proxy, or the ``generate --tp 2`` launcher) and speaks one JSON
object per line. The message shapes are fixed by docs/engine.md; the constructors
here are the only place that spells them, so rank and clients cannot drift.

rank -> client: ready | fatal | progress | token | done | error | pong | fault_armed | heartbeat
client -> rank: generate | cancel | ping | fault
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from engine.service.causes import RANK_HOOKS, Cause

FINISH_REASONS = ("length", "stop", "cancelled")


class ProtocolError(Exception):
    """A line that is not a protocol message, or the peer went away."""


# ---- rank -> client -------------------------------------------------------------------------

def ready(rank: int, pid: int, generation: int, allreduce: str, selftest: str,
          race: dict[str, dict[str, float]] | None, max_context: int, vocab_size: int,
          decode: dict[str, Any] | None = None, choice: dict[str, Any] | None = None,
          context: dict[str, Any] | None = None, concurrency: dict[str, Any] | None = None) -> dict[str, Any]:
    """``decode``: how this rank decodes and why (engine.core.runner.Decoder.info) and the card's read
    bandwidth with its source (read_bw_gbps, read_bw_source: measured | measured earlier | flag). ``choice``: why the
    allreduce path was chosen and every candidate's self-test result or the reason it was skipped. ``context``: the
    context served and which bound chose it (engine.service.context_default.choose). ``concurrency``: the sequence
    slots held and which bound chose them (engine.service.concurrency_default)."""
    return {"type": "ready", "rank": rank, "pid": pid, "generation": generation, "allreduce": allreduce,
            "selftest": selftest, "race": race, "max_context": max_context, "vocab_size": vocab_size,
            "decode": decode, "choice": choice, "context": context, "concurrency": concurrency}


def fatal(message: str, cause: Cause = Cause.STARTUP) -> dict[str, Any]:
    """``cause``: why the rank gives up, from engine/service/causes.py (the proxy reads it, never the text)."""
    return {"type": "fatal", "message": message, "cause": Cause(cause).value}


def progress(req_id: str, done_tokens: int, counter: int) -> dict[str, Any]:
    return {"type": "progress", "id": req_id, "phase": "prefill", "done_tokens": done_tokens, "counter": counter}


def token(req_id: str, step: int, token_id: int, counter: int, logprobs: list | None = None) -> dict[str, Any]:
    """``logprobs``: [the token's log-probability, [[id, logprob], ...] the most likely], when the request asked."""
    msg = {"type": "token", "id": req_id, "step": step, "token_id": token_id, "counter": counter}
    if logprobs is not None:
        msg["logprobs"] = logprobs
    return msg


def done(req_id: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
         decode: dict[str, Any] | None = None, cached_tokens: int = 0) -> dict[str, Any]:
    """``decode``: the rank's decode figures so far (engine.core.runner.Decoder.stats: ms per step and
    per token, achieved GB/s, fraction of the read bandwidth), for /metrics, /health and the log."""
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
    msg = {"type": "done", "id": req_id, "finish_reason": finish_reason, "prompt_tokens": prompt_tokens,
           "completion_tokens": completion_tokens, "cached_tokens": cached_tokens}
    if decode is not None:
        msg["decode"] = decode
    return msg


def error(req_id: str | None, message: str) -> dict[str, Any]:
    return {"type": "error", "id": req_id, "message": message}


def pong(counter: int, busy: bool) -> dict[str, Any]:
    return {"type": "pong", "counter": counter, "busy": busy}


def heartbeat(counter: int, busy: bool, wait_s: float) -> dict[str, Any]:
    """Sent every heartbeat period by a thread of its own once the rank is ready: a rank that
    is frozen (or dead) falls silent. ``wait_s`` is how long the rank has been waiting for its
    peer inside one allreduce (0 when it is not waiting): a rank waiting long means the PEER is
    stalled, while this rank is alive."""
    return {"type": "heartbeat", "counter": counter, "busy": busy, "wait_s": round(float(wait_s), 3)}


def fault_armed(what: str, at_step: int | None) -> dict[str, Any]:
    return {"type": "fault_armed", "what": what, "at_step": at_step}


# ---- client -> rank -------------------------------------------------------------------------

def generate(req_id: str, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, stop_token_ids: list[int] | None = None, sampling: dict | None = None,
             grammar: dict | None = None, images: list[str] | None = None) -> dict[str, Any]:
    """``sampling``: engine.core.logits_processors.Processing's fields (top_k, min_p, penalties, logit_bias as
    [[id, bias]], logprobs); ``grammar``: engine.core.grammar's spec of a constrained answer; ``images``: base64
    of each image's file bytes, in prompt order (engine.vision.serve). Absent: plain, no images."""
    msg = {"type": "generate", "id": req_id, "prompt_ids": list(prompt_ids), "max_tokens": int(max_tokens),
           "temperature": float(temperature), "top_p": float(top_p), "seed": int(seed),
           "stop_token_ids": list(stop_token_ids or [])}
    if sampling:
        msg["sampling"] = sampling
    if grammar:
        msg["grammar"] = grammar
    if images:
        msg["images"] = list(images)
    return msg


def cancel(req_id: str) -> dict[str, Any]:
    return {"type": "cancel", "id": req_id}


def ping() -> dict[str, Any]:
    return {"type": "ping"}


def fault(what: str, at_step: int | None = None) -> dict[str, Any]:
    if what not in RANK_HOOKS:
        raise ValueError(f"fault must be one of {RANK_HOOKS}, got {what!r}")
    return {"type": "fault", "what": what, "at_step": at_step}


# ---- parsing --------------------------------------------------------------------------------

_REQUIRED = {
    "ready": ("rank", "pid", "generation", "allreduce", "selftest", "max_context", "vocab_size"),
    "fatal": ("message",),
    "progress": ("id", "done_tokens", "counter"),
    "token": ("id", "step", "token_id", "counter"),
    "done": ("id", "finish_reason", "prompt_tokens", "completion_tokens"),
    "error": ("message",),
    "pong": ("counter", "busy"),
    "heartbeat": ("counter", "busy", "wait_s"),
    "fault_armed": ("what",),
    "generate": ("id", "prompt_ids", "max_tokens"),
    "cancel": ("id",),
    "ping": (),
    "fault": ("what",),
}


def encode(msg: dict[str, Any]) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def decode(line: bytes | str) -> dict[str, Any]:
    """One line -> one message dict; ProtocolError naming what is wrong."""
    try:
        msg = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"not a JSON line: {e}") from None
    if not isinstance(msg, dict) or msg.get("type") not in _REQUIRED:
        raise ProtocolError(f"unknown message type in {str(line)[:200]!r}")
    missing = [k for k in _REQUIRED[msg["type"]] if k not in msg]
    if missing:
        raise ProtocolError(f"{msg['type']} message lacks {', '.join(missing)}")
    return msg


class LineSocket:
    """A connected stream socket read and written one JSON line at a time."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = b""

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(encode(msg))

    def recv(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The next message; ProtocolError on EOF, TimeoutError when ``timeout_s`` passes first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no message within {timeout_s} s")
                self.sock.settimeout(left)
            else:
                self.sock.settimeout(None)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                raise TimeoutError(f"no message within {timeout_s} s") from None
            if not chunk:
                raise ProtocolError("connection closed by the peer")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return decode(line)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class RankClient:
    """Blocking client of one rank's control socket (for scripts and the protocol's tests; the service
    and `generate --tp 2` speak through engine.service.proxy_ranks).

    ``connect`` retries until the rank has created its socket; ``wait_ready``
    returns the ready message or raises ProtocolError with the rank's fatal message.
    """

    def __init__(self, path: str, connect_timeout_s: float = 60.0):
        self.path = path
        deadline = time.monotonic() + connect_timeout_s
        last: Exception | None = None
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                break
            except OSError as e:  # not created yet, or not listening yet
                sock.close()
                last = e
                if time.monotonic() > deadline:
                    raise ProtocolError(f"could not connect to rank socket {path} within "
                                        f"{connect_timeout_s} s: {last}") from None
                time.sleep(0.05)
        self.conn = LineSocket(sock)

    def send(self, msg: dict[str, Any]) -> None:
        self.conn.send(msg)

    def recv(self, timeout_s: float | None = None) -> dict[str, Any]:
        return self.conn.recv(timeout_s)

    def wait_ready(self, timeout_s: float = 300.0) -> dict[str, Any]:
        msg = self.recv(timeout_s)
        if msg["type"] == "fatal":
            raise ProtocolError(f"rank failed to start: {msg['message']}")
        if msg["type"] != "ready":
            raise ProtocolError(f"expected ready, got {msg['type']}")
        return msg

    def ping(self, timeout_s: float = 10.0) -> dict[str, Any]:
        self.send(ping())
        while True:
            msg = self.recv(timeout_s)
            if msg["type"] == "pong":
                return msg

    def close(self) -> None:
        self.conn.close()


def socket_path_ok(path: str) -> str | None:
    """Why ``path`` cannot be a control socket path, or None (AF_UNIX paths are limited to ~107 bytes)."""
    if len(os.fsencode(path)) > 100:
        return f"control socket path is {len(os.fsencode(path))} bytes; Unix sockets allow about 100"
    return None
