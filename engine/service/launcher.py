"""Starts two rank processes, speaks the protocol to both and collects one request's result.

Used by ``generate --tp 2``. Both ranks get the same request; the result is rank 0's,
and the launcher also checks that rank 1 produced the same tokens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from engine import BUNDLE_ROOT
from engine.service import protocol


class LaunchError(RuntimeError):
    pass


class RankPair:
    def __init__(self, model: str, devices: list[str], dtype: str, allreduce: str, max_context: int,
                 timeout_s: float = 60.0, extra: list[str] | None = None, stderr=None):
        self.dir = tempfile.mkdtemp(prefix="v100plan-ranks-", dir="/tmp" if os.path.isdir("/tmp") else None)
        self.procs: list[subprocess.Popen] = []
        self.clients: list[protocol.RankClient] = []
        env = dict(os.environ)
        root = str(BUNDLE_ROOT)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        for r in range(2):
            cmd = [sys.executable, "-m", "engine", "rank", "--model", model, "--rank", str(r), "--world", "2",
                   "--rendezvous", os.path.join(self.dir, "rdv"), "--control-socket", self.sock(r),
                   "--device", devices[r], "--dtype", dtype, "--allreduce", allreduce,
                   "--max-context", str(max_context), "--allreduce-timeout-s", str(timeout_s)] + list(extra or [])
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr))
        try:
            self.clients = [protocol.RankClient(self.sock(r), connect_timeout_s=120) for r in range(2)]
            self.ready = [c.wait_ready(timeout_s=600) for c in self.clients]
        except (protocol.ProtocolError, TimeoutError) as e:
            self.close()
            raise LaunchError(str(e)) from None

    def sock(self, r: int) -> str:
        return os.path.join(self.dir, f"rank{r}.sock")

    def generate(self, msg: dict, timeout_s: float = 600.0) -> tuple[list[list[int]], list[dict]]:
        """Send ``msg`` to both ranks; returns (tokens per rank, done message per rank)."""
        tokens: list[list[int]] = [[], []]
        done: list[dict | None] = [None, None]
        errors: list[str | None] = [None, None]

        def collect(r: int) -> None:
            try:
                while True:
                    m = self.clients[r].recv(timeout_s)
                    if m["type"] == "token":
                        tokens[r].append(m["token_id"])
                    elif m["type"] == "done":
                        done[r] = m
                        return
                    elif m["type"] in ("error", "fatal"):
                        errors[r] = f"rank {r}: {m['message']}"
                        return
            except (protocol.ProtocolError, TimeoutError) as e:
                errors[r] = f"rank {r}: {e}"

        for c in self.clients:
            c.send(msg)
        threads = [threading.Thread(target=collect, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(errors):
            raise LaunchError("; ".join(e for e in errors if e))
        return tokens, done  # type: ignore[return-value]

    def close(self) -> None:
        for c in self.clients:
            c.close()
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
