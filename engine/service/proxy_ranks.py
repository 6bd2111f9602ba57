"""One generation of the two rank processes: start them, talk to them, kill them.

Each rank is `python -m engine rank ...` (a child of serve) listening on a Unix
socket; we connect once and exchange newline-delimited JSON (docs/engine.md). A
reader task per rank puts every message on that rank's inbox and stamps the time
of the last message, which the watchdog reads. Nothing here decides policy: the
service (proxy_service.py) and the watchdog (watchdog.py) do.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import glob
import hashlib
import os
import secrets
import select
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine import BUNDLE_ROOT
from engine.service import protocol
from engine.service.causes import Cause, Failure, exit_cause
from engine.service.rank_forks import ForkedRank, RankForks
from engine.service.serve_config import ServeConfig, rank_command

# Unix socket paths are limited to 107 bytes on Linux; deep test directories exceed it.
_SUN_PATH_MAX = 100
_PR_SET_PDEATHSIG = 1
_LINE_LIMIT = 1 << 24  # a control message longer than this ends the link (as a closed socket would)


def _load_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: the socket EOF still tells the rank to exit


# Looked up here, in the parent: between fork and exec the child may only make the call itself
# (a dlopen there could wait forever on a loader lock another thread held at fork time).
_PRCTL = _load_prctl()


def die_with_parent() -> None:
    """Runs in the child before exec: the kernel SIGKILLs the rank when serve dies, even by
    SIGKILL, so a killed proxy never leaves an orphan rank holding the GPU."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


class RankStartError(Exception):
    """The pair did not come up; the message says which rank and why (its log tail), ``cause`` its kind."""

    def __init__(self, message: str, cause: Cause = Cause.STARTUP):
        super().__init__(message)
        self.cause = cause


class RankRequestError(Exception):
    """A request failed on one or both ranks (RankPair.collect); the message names each rank's reason."""


def rank_env() -> dict[str, str]:
    """A rank's environment: unbuffered output (its log is read while it runs), and the bundle on
    the import path, so `python -m engine rank` works from any working directory."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(BUNDLE_ROOT) + (os.pathsep + path if path else "")}


@dataclass
class RankLink:
    rank: int
    proc: asyncio.subprocess.Process | ForkedRank
    socket_path: str
    log_path: str
    sock: socket.socket | None = None
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # until ready; then `sink`
    sink: asyncio.Queue | None = None                            # the pair's merged queue
    ready: dict | None = None
    last_message_monotonic: float = field(default_factory=time.monotonic)
    last_progress_monotonic: float = field(default_factory=time.monotonic)  # when the counter last moved
    last_counter: int | None = None
    wait_s: float = 0.0            # from the last heartbeat: how long this rank has waited for its peer
    last_heartbeat_monotonic: float | None = None
    max_heartbeat_gap_s: float = 0.0  # the longest silence between two heartbeats so far (the liveness margin)
    eof: bool = False
    fatal_message: str | None = None
    fatal_cause: Cause | None = None  # the cause the rank's fatal message names
    ping_sent_monotonic: float | None = None  # an unanswered ping's send time
    fault_replies: asyncio.Queue = field(default_factory=asyncio.Queue)  # fault_armed answers only
    _loop: asyncio.AbstractEventLoop | None = None
    _reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exited(self) -> bool:
        return self.proc.returncode is not None

    async def connect(self) -> None:
        """Connect the control socket and start reading it on a thread of its own."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock, self._loop = sock, asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read_thread, name=f"rank{self.rank}-reader", daemon=True)
        self._reader.start()

    async def send(self, message: dict) -> None:
        if self.sock is None or self.sock.fileno() < 0:
            raise ConnectionError(f"rank {self.rank}: control socket is closed")
        await asyncio.get_running_loop().sock_sendall(self.sock, protocol.encode(message))

    def close_socket(self) -> None:
        """Shut the control socket (the reader thread sees its end and stops), then close it."""
        sock, self.sock = self.sock, None
        if sock is None:
            return
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(2.0)
        sock.close()

    def _read_thread(self) -> None:
        """Every message of the rank, read here rather than on the event loop: a heartbeat is stamped the
        moment it arrives, however busy the loop is (the watchdog judges silence by these stamps), and
        everything but heartbeats and pongs is handed to the loop in order."""
        sock, buf = self.sock, b""
        while True:
            try:
                ready, _, _ = select.select([sock], [], [], 1.0)
                chunk = sock.recv(1 << 16) if ready else None
            except BlockingIOError:
                continue
            except (OSError, ValueError):
                chunk = b""
            if chunk is None:
                continue
            if not chunk or len(buf) > _LINE_LIMIT:
                self.eof = True
                self._deliver({"type": "eof", "_rank": self.rank})
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                self._take(line + b"\n")

    def _take(self, line: bytes) -> None:
        try:
            msg = protocol.decode(line)
        except protocol.ProtocolError:
            return  # not a protocol message; the rank's log has the context
        now = time.monotonic()
        self.last_message_monotonic = now
        if "counter" in msg:
            if msg["counter"] != self.last_counter:
                self.last_progress_monotonic = now
            self.last_counter = msg["counter"]
        kind = msg.get("type")
        if kind == "heartbeat":
            self.wait_s = float(msg.get("wait_s") or 0.0)
            if self.last_heartbeat_monotonic is not None:
                self.max_heartbeat_gap_s = max(self.max_heartbeat_gap_s, now - self.last_heartbeat_monotonic)
            self.last_heartbeat_monotonic = now
            return
        if kind == "pong":
            self.ping_sent_monotonic = None
            return
        if kind == "fatal":
            self.fatal_message = str(msg.get("message"))
            try:
                self.fatal_cause = Cause(msg.get("cause"))
            except ValueError:
                self.fatal_cause = Cause.EXIT  # a rank of another version: it did give up
        msg["_rank"] = self.rank
        self._deliver(msg)

    def _deliver(self, msg: dict) -> None:
        def put() -> None:
            if msg.get("type") == "fault_armed":
                self.fault_replies.put_nowait(msg)
            else:
                (self.inbox if self.sink is None else self.sink).put_nowait(msg)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(put)

    def log_tail(self, lines: int = 12) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])


@dataclass
class RankPair:
    generation: int
    links: list[RankLink]
    run_dir: str
    allreduce: str | None = None
    race: dict | None = None
    max_context: int | None = None
    context: dict | None = None  # the context served and its bound (engine.service.context_default.choose)
    concurrency: dict | None = None  # the slots the ranks hold and their bound (engine.service.concurrency_default)
    vocab_size: int | None = None
    started_unix: float = field(default_factory=time.time)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # both ranks' messages, tagged "_rank"
    failure: Failure | None = None                               # set once, by whoever sees it first

    def fail(self, failure: Failure) -> None:
        if self.failure is None:
            self.failure = failure

    @property
    def pids(self) -> list[int]:
        return [link.pid for link in self.links]

    async def collect(self, message: dict, timeout_s: float) -> tuple[list[list[int]], list[dict]]:
        """Send one generate `message` to both ranks and wait for both to end it: (the token ids of
        each rank, each rank's done message). For a caller that runs one request at a time and
        owns the pair (`generate --tp 2`); the service runs its requests in proxy_service.py.
        Raises RankRequestError naming each rank that answered an error, failed or closed."""
        tokens: list[list[int]] = [[], []]
        done: list[dict | None] = [None, None]
        errors: dict[int, str] = {}
        for link in self.links:
            await link.send(message)
        deadline = time.monotonic() + timeout_s
        while any(done[r] is None and r not in errors for r in (0, 1)):
            try:
                msg = await asyncio.wait_for(self.queue.get(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                for r in (0, 1):
                    if done[r] is None:
                        errors.setdefault(r, f"no answer within {timeout_s:g} s")
                break
            r, kind = msg["_rank"], msg.get("type")
            if kind in ("fatal", "eof"):
                errors.setdefault(r, msg.get("message") or "closed its control socket")
            elif msg.get("id") != message.get("id"):
                continue
            elif kind == "token":
                tokens[r].append(msg["token_id"])
            elif kind == "done":
                done[r] = msg
            elif kind == "error":
                errors[r] = str(msg.get("message"))
        if errors:
            raise RankRequestError("; ".join(f"rank {r}: {errors[r]}" for r in sorted(errors)))
        return tokens, done  # type: ignore[return-value]

    async def close(self, grace_s: float = 2.0) -> None:
        """Stop both ranks: SIGTERM (and SIGCONT, so a frozen rank can act on it), then SIGKILL
        whatever is still there after the grace period. Always reaps both."""
        for link in self.links:
            link.close_socket()
            if not link.exited:
                for sig in (signal.SIGTERM, signal.SIGCONT):
                    try:
                        link.proc.send_signal(sig)
                    except ProcessLookupError:
                        pass
        deadline = time.monotonic() + grace_s
        for link in self.links:
            try:
                await asyncio.wait_for(link.proc.wait(), max(0.05, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                try:
                    link.proc.kill()
                except ProcessLookupError:
                    pass
                await link.proc.wait()
        remove_run_dir(self.run_dir)


# The host mailbox's file names (engine/allreduce/host_mailbox.py, mailbox_file): the secret key
# of one start, read from the rendezvous directory, is part of every name. Spelled again here so
# the proxy can clean up after killed ranks without importing torch.
MAILBOX_KEY_FILE = "mailbox.key"
MAILBOX_GLOB = "v100plan-mbox-{key}*"  # the start's private directory (and files of older versions)


def new_mailbox_key(rendezvous_dir: str) -> str:
    """A fresh 128-bit key for this start's mailbox names, in a 0600 file of the 0700
    rendezvous directory: nobody else can guess the names, so nobody can pre-create them."""
    key = secrets.token_hex(16)
    fd = os.open(os.path.join(rendezvous_dir, MAILBOX_KEY_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key)
    return key


def _mailbox_dirs() -> list[str]:
    return [d for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d)]


def remove_run_dir(run_dir: str) -> None:
    """A run directory and the mailbox files its ranks may have left (killed before they unlinked them)."""
    try:
        with open(os.path.join(run_dir, "rdv", MAILBOX_KEY_FILE)) as fh:
            key = fh.read().strip()
    except OSError:
        key = ""
    if key.isalnum():
        for d in _mailbox_dirs():
            for path in glob.glob(os.path.join(d, MAILBOX_GLOB.format(key=key))):
                try:
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path)  # the start's private directory, with what killed ranks left
                    else:
                        os.unlink(path)
                except OSError:
                    pass
    shutil.rmtree(run_dir, ignore_errors=True)


def _fallback_prefix(state_dir: str) -> str:
    return "v100plan-run-" + hashlib.sha1(state_dir.encode()).hexdigest()[:10] + "-"


def reap_stale_runs(state_dir: str) -> list[str]:
    """At start (holding the state directory's lock, so no other serve uses it): remove the run
    directories of earlier proxies (killed by SIGKILL, they could not clean up), with their
    stale sockets, rendezvous stores and mailbox files."""
    found = glob.glob(os.path.join(state_dir, "run", "*"))
    found += glob.glob(os.path.join(tempfile.gettempdir(), _fallback_prefix(state_dir) + "*"))
    for path in found:
        remove_run_dir(path)
    return found


def _run_dir(state_dir: str, generation: int) -> str:
    base = os.path.join(state_dir, "run")
    candidate = os.path.join(base, f"g{generation}")
    if len(os.path.join(candidate, "r0.sock")) > _SUN_PATH_MAX:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        return tempfile.mkdtemp(prefix=_fallback_prefix(state_dir) + f"g{generation}-")
    remove_run_dir(candidate)
    os.makedirs(base, mode=0o700, exist_ok=True)
    os.makedirs(candidate, mode=0o700)
    return candidate


async def start_pair(cfg: ServeConfig, generation: int, rank1_extra: tuple[str, ...] = (),
                     forks: RankForks | None = None, extra: tuple[tuple[str, ...], ...] = ((), ())) -> RankPair:
    """Start both ranks of `generation` and wait for both `ready` messages; forked by `forks`
    (torch already imported) while that fork server runs, else as new processes. ``extra[r]``: rank r's
    further flags (a restart's reuse of what the previous pair measured), ``rank1_extra`` after them.

    Raises RankStartError (after killing whatever started) on a fatal message, an
    early exit, or cfg.start_timeout_s without both ready.
    """
    run_dir = _run_dir(cfg.state_dir, generation)
    rendezvous = os.path.join(run_dir, "rdv")
    os.makedirs(rendezvous, mode=0o700, exist_ok=True)
    new_mailbox_key(rendezvous)
    log_dir = os.path.join(cfg.state_dir, "logs")
    os.makedirs(log_dir, mode=0o700, exist_ok=True)
    links: list[RankLink] = []
    for rank in (0, 1):
        sock = os.path.join(run_dir, f"r{rank}.sock")
        log_path = os.path.join(log_dir, f"rank{rank}.g{generation}.log")
        cmd = rank_command(cfg, rank, generation, rendezvous, sock, extra[rank] + (rank1_extra if rank == 1 else ()))
        proc = await forks.fork(cmd[4:], log_path) if forks is not None else None  # the flags after `rank`
        if proc is None:
            with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
                proc = await asyncio.create_subprocess_exec(
                    *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                    preexec_fn=die_with_parent,
                    env=rank_env(),
                )
        links.append(RankLink(rank=rank, proc=proc, socket_path=sock, log_path=log_path))
    pair = RankPair(generation=generation, links=links, run_dir=run_dir)
    try:
        await asyncio.wait_for(asyncio.gather(*(_connect_and_wait_ready(link) for link in links)),
                               cfg.start_timeout_s)
    except asyncio.TimeoutError:
        await pair.close(grace_s=0.5)
        raise RankStartError(f"ranks not ready within {cfg.start_timeout_s:g} s") from None
    except (RankStartError, asyncio.CancelledError):  # cancelled: serve is shutting down mid-start
        await pair.close(grace_s=0.5)
        raise
    r0 = links[0].ready or {}
    pair.allreduce = r0.get("allreduce")
    pair.race = r0.get("race")
    # Each rank chose its context (engine/service/context_default.py); cards that differ may give two: the smaller.
    contexts = [link.ready.get("max_context") for link in links]
    pair.max_context = min(contexts) if all(isinstance(c, int) for c in contexts) else r0.get("max_context")
    pair.context = dict(next((link.ready.get("context") for link in links
                              if link.ready.get("max_context") == pair.max_context), None) or {}) or None
    # The ranks agree on their slots (the smaller figure); a rank too old to say: None.
    held = [link.ready.get("concurrency") for link in links]
    pair.concurrency = min((c for c in held if isinstance(c, dict) and isinstance(c.get("max_concurrency"), int)),
                           key=lambda c: c["max_concurrency"], default=None)
    pair.vocab_size = r0.get("vocab_size")
    for link in links:
        if link.ready.get("selftest") != "passed":
            await pair.close(grace_s=0.5)
            raise RankStartError(f"rank {link.rank}: allreduce self-test {link.ready.get('selftest')!r}",
                                 Cause.SELFTEST)
    if links[1].ready.get("allreduce") != pair.allreduce:
        await pair.close(grace_s=0.5)
        raise RankStartError(
            f"ranks disagree on the allreduce path: {pair.allreduce} vs {links[1].ready.get('allreduce')}",
            Cause.SELFTEST)
    for link in links:  # from now on both ranks feed one queue, in arrival order
        link.sink = pair.queue
        while not link.inbox.empty():
            pair.queue.put_nowait(link.inbox.get_nowait())
    return pair


async def _connect_and_wait_ready(link: RankLink) -> None:
    while True:
        if link.exited:
            raise RankStartError(
                f"rank {link.rank} exited with code {link.proc.returncode} before it was ready:\n{link.log_tail()}",
                link.fatal_cause or exit_cause(link.proc.returncode))
        if os.path.exists(link.socket_path):
            try:
                await link.connect()
                break
            except (ConnectionRefusedError, FileNotFoundError):
                pass
        await asyncio.sleep(0.05)
    while True:
        msg = await link.inbox.get()
        kind = msg.get("type")
        if kind == "ready":
            link.ready = msg
            return
        if kind in ("fatal", "eof"):
            await asyncio.sleep(0.2)  # let the log receive the rank's last words
            detail = msg.get("message") or f"closed its socket\n{link.log_tail()}"
            raise RankStartError(f"rank {link.rank} failed to start: {detail}", link.fatal_cause or Cause.STARTUP)
