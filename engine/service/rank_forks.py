"""A fork server for rank processes: torch and the engine imported once, every restart's ranks forked.

Importing torch is most of a rank's start on a CPU host (2 s of CPU, 5-10 s of wall time on a
loaded 2-core machine). Serve runs one `python -m engine.service.rank_forks` process that imports
them and then forks a rank per request, in milliseconds, as often as asked: a restart never waits
for an import, however soon it follows the previous one (a pool of pre-imported processes runs dry
when faults come faster than it refills). The fork server never touches a GPU, so each forked rank
initialises CUDA on its own, as a freshly started one does.

Lines of JSON, serve -> server (stdin): {"argv": [rank flags], "log": path}, {"bye": true} before a
clean stop; server -> serve (stdout): {"ready": true} once imported, {"pid": N} per fork in request
order, {"exit": N, "code": C} when a rank ended (C as asyncio gives it: -9 for SIGKILL). A forked
rank is SIGKILLed by the kernel when the server dies.

The server outlives a killed proxy (kill_proxy): when its stdin ends without "bye", it SIGKILLs the
ranks it forked (its own children, not yet reaped) and waits ADOPT_WAIT_S on ``--adopt-socket`` (a
0600 Unix socket in the 0700 state directory; a peer of another uid is refused) for the proxy its
supervisor starts next, which takes it over with the same protocol over the socket. The next proxy's
first pair then needs no import of torch: that import (3-6 s of a loaded 2-core CPU) was most of a
proxy's restart. Nobody adopts it in time, or "bye": it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import importlib
import json
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
import traceback

_PR_SET_PDEATHSIG = 1
ADOPT_WAIT_S = 30.0  # how long a server whose proxy was killed waits for the next one


def _preload(gpu: bool = False) -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from engine.allreduce import comm, dist, epilogue, host_mailbox, select  # noqa: F401
    from engine.core import model, runner, weights  # noqa: F401

    # With what a rank imports later, on its own, each time (none of it touches a GPU).
    for name in ("kernels.decode", "kernels.gdn", "kernels.gdn_chunk", "core.kvquant",
                 "core.lockstep", "core.mtp", "core.prefill_attention", "core.prefix", "core.quant", "core.spec_graphs",
                 "core.speculative"):
        try:
            importlib.import_module(f"engine.{name}")
        except ImportError:  # (Triton absent) the rank that needs it says so with its context
            pass

    # GPU ranks only: the prefill's attention on a GPU takes torch.nn.attention.bias, which imports torch._dynamo,
    # sympy and FSDP: measured on one H200 (2026-12-02, docs/service.md "Start-up"), 5-6 s of every restarted
    # rank's start; a CPU rank never imports it (1.3 s here that it would only cost).
    if gpu:
        import torch.multiprocessing.reductions  # noqa: F401
        import torch.nn.attention.bias  # noqa: F401

    try:  # the decoder asks whether Triton is there (engine.core.runner): 0.6-1.5 s of every rank's start on
        import triton  # noqa: F401  a CPU host when each forked rank imported it itself (it touches no GPU)
    except ImportError:
        pass


def _child(argv: list[str], log_path: str, server_pid: int, prctl, close_fds: tuple[int, ...]) -> None:
    """In the forked process: die with the server, write to the rank's log, run the rank. Never returns."""
    code = 1
    try:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        for fd in close_fds:  # the server's adoption socket and its proxy's connection are not the rank's
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a rank as a new one: Ctrl-C interrupts it
        if os.getppid() != server_pid:  # the server died before the prctl took effect
            os._exit(1)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        from engine.service import rank_cli

        rank_cli.main(argv)  # exits the process itself (os._exit)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the rank's log gets it; the process must not return to the loop
        traceback.print_exc()
    finally:
        os._exit(code)


def _reply(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())  # no Python buffer a fork could inherit


def peer_uid_pid(sock: socket.socket) -> tuple[int, int]:
    """The (uid, pid) the kernel records for the other end of a Unix socket (SO_PEERCRED)."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid, pid


def _listen(path: str) -> tuple[socket.socket, int] | None:
    """The adoption socket (0600; the state directory around it is 0700 and ours); None if it cannot be made."""
    try:
        if os.path.lexists(path):
            os.unlink(path)  # a server that died left it; a live one waiting for adoption was asked first
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        sock.listen(1)
        return sock, os.stat(path).st_ino
    except OSError:
        traceback.print_exc()
        return None


def _adopted(listener: socket.socket, wait_s: float) -> socket.socket | None:
    """The next proxy's connection (this user's only) within ``wait_s``, or None."""
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([listener], [], [], left)
        if not readable:
            return None
        conn, _ = listener.accept()
        if peer_uid_pid(conn)[0] == os.getuid():
            return conn
        conn.close()  # another user: never
    return None


def _serve(rfd: int, wfd: int, me: int, prctl, children: set[int], close_fds: tuple[int, ...]) -> bool:
    """Fork a rank per request line until the proxy says bye (True) or its end closes (False)."""
    pending = b""
    while True:
        readable, _, _ = select.select([rfd], [], [], 0.05)
        if readable:
            try:
                chunk = os.read(rfd, 1 << 16)
            except ConnectionError:
                chunk = b""
            if not chunk:
                return False
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if request.get("bye"):
                    return True
                pid = os.fork()
                if pid == 0:
                    _child([str(a) for a in request["argv"]], str(request["log"]), me, prctl, close_fds)
                children.add(pid)
                try:
                    _reply(wfd, {"pid": pid})
                except OSError:
                    return False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            try:
                _reply(wfd, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
            except OSError:
                return False


def _end_ranks(children: set[int]) -> None:
    """SIGKILL and reap the ranks forked for a proxy that is gone: this process's own children, not yet
    reaped, so each pid is still the rank it forked."""
    for pid in sorted(children):
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    children.clear()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.service.rank_forks")
    p.add_argument("--adopt-socket", metavar="PATH", help="outlive a killed proxy: wait here for the next one")
    p.add_argument("--gpu", action="store_true", help="the ranks run on GPUs: import what their prefill needs")
    args = p.parse_args(argv)
    # A Ctrl-C in serve's terminal reaches its whole process group: serve drains and then ends this
    # server by closing its stdin; the signal itself must not end it (and its ranks) first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _preload(args.gpu)
    except Exception:  # noqa: BLE001 - a forked rank reports the same import error with its context
        traceback.print_exc()
    # Looked up before any fork: a child must not dlopen (a loader lock held at fork time is held forever).
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    bound = _listen(args.adopt_socket) if args.adopt_socket else None
    listener = bound[0] if bound else None
    me, children, rfd, wfd, conn = os.getpid(), set(), 0, 1, None
    try:
        _reply(wfd, {"ready": True})
        while True:
            fds = tuple(f for f in (listener.fileno() if listener else None, rfd if conn else None) if f is not None)
            bye = _serve(rfd, wfd, me, prctl, children, fds)
            _end_ranks(children)
            if conn is not None:
                conn.close()
            if bye or listener is None:
                return 0
            conn = _adopted(listener, ADOPT_WAIT_S)
            if conn is None:
                return 0
            rfd = wfd = conn.fileno()
            _reply(wfd, {"ready": True})
    finally:
        if bound is not None:
            listener.close()
            try:
                if os.stat(args.adopt_socket).st_ino == bound[1]:  # ours, not a later server's
                    os.unlink(args.adopt_socket)
            except OSError:
                pass


# ----- serve's side ---------------------------------------------------------------------------------


class ForkedRank:
    """A rank forked by the server, with the part of asyncio.subprocess.Process the service uses
    (it is the server's child, not serve's: its exit code arrives from the server)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._exited = asyncio.Event()

    def _ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._exited.set()

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def wait(self) -> int:
        await self._exited.wait()
        return self.returncode  # type: ignore[return-value]


class _Adopted:
    """A fork server started with subprocess.Popen before serve's event loop ran (serve starts it
    before its own imports, so torch's import overlaps them), with the part of
    asyncio.subprocess.Process that RankForks uses."""

    def __init__(self, popen: subprocess.Popen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.popen, self.stdout, self.stdin, self.pid = popen, reader, writer, popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    async def wait(self) -> int:
        while self.popen.poll() is None:
            await asyncio.sleep(0.05)
        return self.popen.returncode

    def kill(self) -> None:
        self.popen.kill()


class _Remote:
    """A fork server a killed proxy left, taken over through its adoption socket (not this process's
    child: it is gone when its socket closes), with the part of asyncio.subprocess.Process RankForks uses."""

    def __init__(self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.pid, self.stdout, self.stdin = pid, reader, writer
        self._gone = asyncio.Event()

    @property
    def returncode(self) -> int | None:
        return 0 if self._gone.is_set() else None

    async def wait(self) -> int:
        await self._gone.wait()
        return 0

    def kill(self) -> None:
        if not self._gone.is_set():  # its pid as the kernel gave it for the socket's peer, still connected
            os.kill(self.pid, signal.SIGKILL)


def connect_waiting(path: str) -> tuple[socket.socket, int] | None:
    """The fork server waiting on ``path`` for a proxy (a socket this user owns, a peer of this uid), or None."""
    try:
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(2.0)
        sock.connect(path)
        uid, pid = peer_uid_pid(sock)
        if uid != os.getuid():
            sock.close()
            return None
        sock.setblocking(False)
        return sock, pid
    except OSError:
        return None


class RankForks:
    """Serve's handle on one fork server: started once (or taken over from a killed proxy through
    ``adopt_socket``), started again if it died."""

    def __init__(self, log_path: str, preexec_fn=None, env: dict[str, str] | None = None,
                 adopt_socket: str | None = None, gpu: bool = False):
        self.log_path = log_path
        self.gpu = gpu
        # A server that may be adopted must outlive its proxy: no parent-death signal (it ends its ranks
        # itself when the proxy's end closes, and exits when nobody adopts it).
        self.preexec_fn = None if adopt_socket else preexec_fn
        self.env = env
        self.adopt_socket = adopt_socket
        self.adopted = False
        self._waiting: tuple[socket.socket, int] | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self._forks: asyncio.Queue = asyncio.Queue()    # pids in request order
        self._ranks: dict[int, ForkedRank] = {}
        self._reader: asyncio.Task | None = None
        self._early: subprocess.Popen | None = None

    def spawn_early(self) -> None:
        """Start the server now, before an event loop runs: serve calls this before its own imports,
        so the server's import of torch runs while serve imports its web stack (a restarted proxy's
        first pair is up that much sooner). start() adopts it. A server a killed proxy left waiting on the
        adoption socket is taken over instead: it has imported torch already."""
        if self.adopt_socket and (waiting := connect_waiting(self.adopt_socket)) is not None:
            self._waiting = waiting
            return
        with open(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            self._early = subprocess.Popen(self._command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=log, preexec_fn=self.preexec_fn, env=self.env)

    @property
    def adopting(self) -> bool:
        """spawn_early() found a server a killed proxy left waiting (it is taken over at start())."""
        return self._waiting is not None

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "engine.service.rank_forks", *(["--gpu"] if self.gpu else []),
                *(["--adopt-socket", self.adopt_socket] if self.adopt_socket else [])]

    async def _adopt(self, popen: subprocess.Popen) -> _Adopted:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), popen.stdout)
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, popen.stdin)
        return _Adopted(popen, reader, asyncio.StreamWriter(transport, protocol, reader, loop))

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and self._reader is not None \
            and not self._reader.done()

    async def start(self) -> None:
        """Start the server if it is not running (returns at once; it imports in the background)."""
        if self.alive:
            return
        self.ready = asyncio.Event()
        self._forks = asyncio.Queue()
        early, self._early = self._early, None
        waiting, self._waiting = self._waiting, None
        self.adopted = waiting is not None
        if waiting is not None:
            reader, writer = await asyncio.open_unix_connection(sock=waiting[0])
            self.proc = _Remote(waiting[1], reader, writer)
        elif early is not None and early.poll() is None:
            self.proc = await self._adopt(early)
        else:
            with open(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
                self.proc = await asyncio.create_subprocess_exec(
                    *self._command(), stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, stderr=log, preexec_fn=self.preexec_fn,
                    env=self.env)
        self._reader = asyncio.get_running_loop().create_task(self._read(self.proc))

    async def fork(self, argv: list[str], log_path: str, ready_timeout_s: float = 60.0) -> ForkedRank | None:
        """One rank with these flags (those after `python -m engine rank`), or None when the server
        is not running, or still not done importing after `ready_timeout_s` (the caller then starts
        the rank the slow way)."""
        if not self.alive:
            return None
        try:  # still importing (only right after its start): the rest of that is the fastest way
            await asyncio.wait_for(self.ready.wait(), ready_timeout_s)
        except asyncio.TimeoutError:
            return None
        if not self.alive:
            return None
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"argv": argv, "log": log_path}) + "\n").encode())
            await self.proc.stdin.drain()
        except (ConnectionError, OSError):
            return None
        pid = await self._forks.get()
        return self._ranks.get(pid) if pid is not None else None

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while True:
            line = await proc.stdout.readline()
            if not line:
                break
            msg = json.loads(line)
            if msg.get("ready"):
                self.ready.set()
            elif "pid" in msg:
                self._ranks[msg["pid"]] = ForkedRank(msg["pid"])
                self._forks.put_nowait(msg["pid"])
            elif "exit" in msg and msg["exit"] in self._ranks:
                self._ranks.pop(msg["exit"])._ended(int(msg["code"]))
        # The server is gone, and the kernel killed every rank it forked (parent-death signal).
        for rank in self._ranks.values():
            rank._ended(-int(signal.SIGKILL))
        self._ranks.clear()
        self.ready.set()
        self._forks.put_nowait(None)  # a fork that was waiting for its pid gets None
        if isinstance(proc, _Remote):
            proc._gone.set()
        await proc.wait()

    def discard(self) -> None:
        """Serve ends without serving (a start-up check failed, Ctrl-C while starting): end the server it
        started (its own unreaped child) or tell the one it took over to exit, at once."""
        for popen in (self._early, getattr(self.proc, "popen", None)):
            if popen is not None and popen.poll() is None:
                popen.kill()
                popen.wait()
        sock = self._waiting[0] if self._waiting else None
        writer = self.proc.stdin if isinstance(self.proc, _Remote) else None
        try:
            if sock is not None:
                sock.setblocking(True)
                sock.sendall(b'{"bye": true}\n')
                sock.close()
            elif writer is not None:
                writer.write(b'{"bye": true}\n')
        except OSError:
            pass
        self._early = self._waiting = None

    async def close(self) -> None:
        """End the server (and so every rank it forked) and reap it."""
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            try:  # a clean stop: the server exits now instead of waiting for a proxy to adopt it
                self.proc.stdin.write(b'{"bye": true}\n')
                await self.proc.stdin.drain()
            except (ConnectionError, OSError):
                pass
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 5.0)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


if __name__ == "__main__":
    sys.exit(main())
