"""Reaching a deployed service from here: an SSH local port forward to its loopback port.

The engine binds 127.0.0.1 on the host and answers /control/* to loopback clients only,
so the acceptance suite reaches it through a direct-tcpip channel (Fabric's
``Connection.forward_local``): to the engine the requests come from 127.0.0.1. The API
key is read from the host's 0600 file over SFTP and kept in memory only.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from v100plan.remote.connect import Remote, SshOptions
from v100plan.remote.errors import RemoteFailed
from v100plan.remote.host import DEFAULT_ROOT, RemoteSettings, agent
from v100plan.remote.hosts import HostSpec, parse_host
from v100plan.remote.release import EngineSettings

_RANK_LOG = re.compile(r"^rank(\d+)\.g(\d+)\.log$")
RANK_LOG_TAIL_BYTES = 256 * 1024


@dataclass
class ServiceHandle:
    endpoint: str                                   # http://127.0.0.1:<local port> (the forward)
    api_key: str = field(repr=False)                # never printed
    read_rank_logs: Callable[[], dict[int, str]]    # {rank: its log, every generation, oldest first}
    read_service_log: Callable[[], str] | None = None  # the proxy's structured log (serve --log-file)
    host: str = ""
    release: str | None = None
    remote_port: int | None = None
    engine: dict | None = None                      # launch settings: tp, devices, dtype, allreduce, max_context
    supervised: bool = True                         # supervisord restarts the proxy when it dies


def _free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RemoteFailed(f"the SSH port forward on 127.0.0.1:{port} did not start listening",
                                   hint="run again; another program may have taken the port") from None
            time.sleep(0.05)


@contextlib.contextmanager
def open_service(host_spec: str | HostSpec, remote_root: str = DEFAULT_ROOT, deployment: str = "engine", *,
                 ssh: SshOptions | None = None, python: str = "python3") -> Iterator[ServiceHandle]:
    """The deployed service on ``host_spec`` as a local endpoint, for as long as the block runs."""
    spec = parse_host(host_spec) if isinstance(host_spec, str) else host_spec
    settings = RemoteSettings(root=remote_root, python=python)
    with Remote(spec, ssh or SshOptions()) as remote:
        st = agent(remote, settings, "state", {"root": remote_root, "dep": deployment})
        man = st.get("current_manifest")
        if not st.get("current") or not man:
            raise RemoteFailed(f"{spec.label}: nothing is deployed as {deployment!r} under {remote_root}",
                               hint=f"deploy first: v100plan deploy {spec.label} --demo-model")
        base = f"{st['root']}/{deployment}"
        key = remote.read_text(f"{base}/api_key").strip()
        port = int(man["engine"]["port"])
        logs_dir = f"{base}/run/logs"

        def read_rank_logs() -> dict[int, str]:
            """Each rank's log (every generation, oldest first; the last 256 KiB of each file)."""
            sftp = remote.sftp()
            found: dict[int, list[tuple[int, str]]] = {}
            try:
                names = sftp.listdir(logs_dir)
            except OSError:
                return {}
            for name in names:
                m = _RANK_LOG.match(name)
                if not m:
                    continue
                with sftp.open(f"{logs_dir}/{name}", "r") as fh:
                    size = fh.stat().st_size
                    fh.seek(max(0, size - RANK_LOG_TAIL_BYTES))
                    text = fh.read().decode(errors="replace")
                found.setdefault(int(m[1]), []).append((int(m[2]), text))
            return {r: "".join(t for _, t in sorted(parts)) for r, parts in sorted(found.items())}

        def read_service_log() -> str:
            """The proxy's structured log (the last 1 MiB; the supervisor's stdout capture if absent)."""
            sftp = remote.sftp()
            for rel_path in ("service.log", "logs/serve.stdout.log"):
                try:
                    with sftp.open(f"{base}/run/{rel_path}", "r") as fh:
                        size = fh.stat().st_size
                        fh.seek(max(0, size - 4 * RANK_LOG_TAIL_BYTES))
                        text = fh.read().decode(errors="replace")
                except OSError:
                    continue
                if text:
                    return text
            return ""

        local = _free_local_port()
        with remote.open().forward_local(local, remote_port=port, remote_host="127.0.0.1",
                                         local_host="127.0.0.1"):
            _wait_listening(local)  # Fabric binds the local end in its tunnel thread, after yielding
            yield ServiceHandle(endpoint=f"http://127.0.0.1:{local}", api_key=key, read_rank_logs=read_rank_logs,
                                read_service_log=read_service_log, host=spec.label, release=st["current"],
                                remote_port=port, engine=EngineSettings(**man["engine"]).launch())


def describe(handle: ServiceHandle) -> str:
    return json.dumps({"endpoint": handle.endpoint, "host": handle.host, "release": handle.release})
