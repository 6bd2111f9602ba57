"""A fork server for rank processes: torch and the engine imported once, every restart's ranks forked.

Importing torch is most of a rank's start on a CPU host (2 s of CPU, 5-10 s of wall time on a
loaded 2-core machine). Serve runs one `python -m engine.service.rank_forks` process that imports
them and then forks a rank per request, in milliseconds, as often as asked: a restart never waits
for an import, however soon it follows the previous one (a pool of pre-imported processes runs dry
when faults come faster than it refills). The fork server never touches a GPU, so each forked rank
initialises CUDA on its own, as a freshly started one does.

Lines of JSON, serve -> server (stdin): {"argv": [rank flags], "log": path}; server -> serve
(stdout): {"ready": true} once imported, {"pid": N} per fork in request order, {"exit": N,
"code": C} when a rank ended (C as asyncio gives it: -9 for SIGKILL). A forked rank is SIGKILLed
by the kernel when the server dies, and the server when serve dies; serve closing stdin ends the
server and with it every rank it forked.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import traceback

_PR_SET_PDEATHSIG = 1


def _preload() -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from engine.allreduce import comm, dist, epilogue, host_mailbox, select  # noqa: F401
    from engine.core import model, runner, weights  # noqa: F401

    try:  # the decoder asks whether Triton is there (engine.core.runner): 0.6-1.5 s of every rank's start on
        import triton  # noqa: F401  a CPU host when each forked rank imported it itself (it touches no GPU)
    except ImportError:
        pass


def _child(argv: list[str], log_path: str, server_pid: int, prctl) -> None:
    """In the forked process: die with the server, write to the rank's log, run the rank. Never returns."""
    code = 1
    try:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
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


def _reply(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())  # no Python buffer a fork could inherit


def main() -> int:
    # A Ctrl-C in serve's terminal reaches its whole process group: serve drains and then ends this
    # server by closing its stdin; the signal itself must not end it (and its ranks) first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _preload()
    except Exception:  # noqa: BLE001 - a forked rank reports the same import error with its context
        traceback.print_exc()
    # Looked up before any fork: a child must not dlopen (a loader lock held at fork time is held forever).
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    _reply({"ready": True})
    me, pending = os.getpid(), b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return 0  # serve is gone or done: the ranks die with this process
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child([str(a) for a in request["argv"]], str(request["log"]), me, prctl)
                _reply({"pid": pid})
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


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


class RankForks:
    """Serve's handle on one fork server: started once, started again if it died."""

    def __init__(self, log_path: str, preexec_fn=None, env: dict[str, str] | None = None):
        self.log_path = log_path
        self.preexec_fn = preexec_fn
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self._forks: asyncio.Queue = asyncio.Queue()    # pids in request order
        self._ranks: dict[int, ForkedRank] = {}
        self._reader: asyncio.Task | None = None
        self._early: subprocess.Popen | None = None

    def spawn_early(self) -> None:
        """Start the server now, before an event loop runs: serve calls this before its own imports,
        so the server's import of torch runs while serve imports its web stack (a restarted proxy's
        first pair is up that much sooner). start() adopts it."""
        with open(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            self._early = subprocess.Popen([sys.executable, "-m", "engine.service.rank_forks"], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=log, preexec_fn=self.preexec_fn,
                                           env=self.env)

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
        if early is not None and early.poll() is None:
            self.proc = await self._adopt(early)
        else:
            with open(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
                self.proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "engine.service.rank_forks", stdin=asyncio.subprocess.PIPE,
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
        await proc.wait()

    async def close(self) -> None:
        """End the server (and so every rank it forked) and reap it."""
        if self.proc is None:
            return
        if self.proc.stdin is not None:
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
