"""Reaching a deployed service from here: an SSH local port forward to its loopback port.

The engine binds 127.0.0.1 on the host and answers /control/* to loopback clients only,
so the acceptance suite reaches it through a direct-tcpip channel (Fabric's
``Connection.forward_local``): to the engine the requests come from 127.0.0.1. The API
key is read from the host's 0600 file over SFTP and kept in memory only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

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
    copy_logs: Callable[[Path], Path] | None = None    # every log into a local directory (next to a report)
    host: str = ""
    release: str | None = None
    remote_port: int | None = None
    engine: dict | None = None                      # launch settings: tp, devices, dtype, allreduce, max_context
    supervised: bool = True                         # supervisord restarts the proxy when it dies


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
        live = st.get("live") or {}
        run = f"{base}/run/{live['slot']}" if live.get("slot") else f"{base}/run"  # the serving release's slot
        logs_dir = f"{run}/logs"
        # Rank logs are appended across service starts, and request ids restart with each proxy: only
        # what is written from now on is this run's (sizes now; a file that shrank is read whole).
        start = _sizes(remote.sftp(), logs_dir)

        def read_rank_logs() -> dict[int, str]:
            """Each rank's log since the service was opened (every generation, oldest first; at most the
            last 256 KiB of each file)."""
            sftp = remote.sftp()
            found: dict[int, list[tuple[int, str]]] = {}
            for name, size in _sizes(sftp, logs_dir).items():
                m = _RANK_LOG.match(name)
                if m:
                    since = start.get(name, 0) if size >= start.get(name, 0) else 0
                    text = _tail(sftp, f"{logs_dir}/{name}", RANK_LOG_TAIL_BYTES, since) or ""
                    found.setdefault(int(m[1]), []).append((int(m[2]), text))
            return {r: "".join(t for _, t in sorted(parts)) for r, parts in sorted(found.items())}

        def read_service_log() -> str:
            """The proxy's structured log (the last 1 MiB; the supervisor's stdout capture if absent)."""
            for rel_path in ("service.log", "logs/serve.stdout.log"):
                text = _tail(remote.sftp(), f"{run}/{rel_path}", 4 * RANK_LOG_TAIL_BYTES)
                if text:
                    return text
            return ""

        def copy_logs(dest: Path) -> Path:
            """The service's and ranks' logs into ``dest`` (the last 4 MiB of each; the API key stays there)."""
            dest.mkdir(parents=True, exist_ok=True)
            sftp = remote.sftp()
            try:
                names = [f"logs/{n}" for n in sorted(sftp.listdir(logs_dir)) if n.endswith(".log")]
            except OSError:
                names = []
            for rel_path in ["service.log", *names]:
                text = _tail(sftp, f"{run}/{rel_path}", 16 * RANK_LOG_TAIL_BYTES)
                if text is not None:
                    (dest / Path(rel_path).name).write_text(text)
            return dest

        fwd = _Forward(remote.open().transport, port)
        try:
            yield ServiceHandle(endpoint=f"http://127.0.0.1:{fwd.port}", api_key=key, read_rank_logs=read_rank_logs,
                                read_service_log=read_service_log, copy_logs=copy_logs, host=spec.label,
                                release=st["current"],
                                remote_port=port, engine=EngineSettings(**man["engine"]).launch())
        finally:
            fwd.close()


def _sizes(sftp, directory: str) -> dict[str, int]:  # noqa: ANN001 - a paramiko SFTPClient
    """{file name: size} of the files in a remote directory ({} when it is not there)."""
    try:
        return {a.filename: a.st_size or 0 for a in sftp.listdir_attr(directory)}
    except OSError:
        return {}


def _tail(sftp, path: str, nbytes: int, since: int = 0) -> str | None:  # noqa: ANN001 - a paramiko SFTPClient
    """The last ``nbytes`` of a remote file, none before offset ``since``, as text; None when it cannot
    be read."""
    try:
        with sftp.open(path, "r") as fh:
            fh.seek(max(since, fh.stat().st_size - nbytes))
            return fh.read().decode(errors="replace")
    except OSError:
        return None


def host_target(svc: ServiceHandle, deployment: str, model: str | None = None, model_dir=None,  # noqa: ANN001
                notes: list[str] | None = None):  # noqa: ANN201 - v100plan.accept.context.Target
    """The acceptance suite's target for a deployed engine reached through ``svc`` (mode "host")."""
    from v100plan.accept.context import Target

    return Target(endpoint=svc.endpoint, api_key=svc.api_key, mode="host", host=svc.host, model=model,
                  model_dir=str(model_dir) if model_dir else None, engine=svc.engine, supervised=svc.supervised,
                  read_rank_logs=svc.read_rank_logs, read_service_log=svc.read_service_log,
                  notes=[*(notes or []), f"deployment {deployment!r}, release {svc.release}, reached through an SSH "
                                         f"port forward to the host's 127.0.0.1:{svc.remote_port}"])


class _Forward:
    """A local port forward over the connection's SSH transport (a direct-tcpip channel per connection).

    Fabric's ``forward_local`` opens channels in its one accepting thread, so a single connection
    made while nothing listens on the host (the proxy killed by a fault, its supervisor not yet done)
    ends the whole forward and later clients hang. Here that connection alone is closed at once
    (the client sees what it would see on the host: a refused connection) and the forward goes on.
    """

    def __init__(self, transport, remote_port: int):
        self.transport = transport
        # paramiko logs each refused channel as an ERROR; the forward answers it (the client's connection
        # is refused, as on the host), so while a fault has the proxy down those lines are only noise
        self._quiet = _RefusedChannels()
        transport.logger.addFilter(self._quiet)
        self.remote = ("127.0.0.1", remote_port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._accept, name="ssh-forward", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                client, addr = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, addr), daemon=True).start()

    def _pump(self, client: socket.socket, addr) -> None:  # noqa: ANN001 - (host, port)
        """Copy both ways with blocking reads (a thread each way), never select() on the channel:
        Channel.fileno() gives paramiko a notification pipe that the transport thread may still write to
        while this thread closes the channel, and a write landing on a closed, reused descriptor
        corrupted the SSH connection itself (a client leaving while the answer arrives)."""
        try:
            chan = self.transport.open_channel("direct-tcpip", self.remote, addr, timeout=15)
        except Exception:  # noqa: BLE001 - refused, or the transport is closing: this connection only
            client.close()
            return
        chan.settimeout(0.2)  # the channel's reads wake up to see a stop; the client socket blocks
        done = threading.Event()

        def to_host(data: bytes) -> None:
            while data:
                try:
                    sent = chan.send(data)
                except socket.timeout:  # the host's window is full: wait on, unless the forward stops
                    if done.is_set() or self.stopped.is_set():
                        raise EOFError from None
                    continue
                if sent == 0:  # the channel closed (paramiko answers 0 then)
                    raise EOFError
                data = data[sent:]

        def upstream() -> None:  # client -> host
            try:
                while True:
                    data = client.recv(65536)
                    if not data:
                        break  # the client left: the host sees its connection close, as it would locally
                    to_host(data)
            except (OSError, EOFError):
                pass
            done.set()
            chan.close()  # at once: the host must see the client leave now (a cancel), not at the next timeout

        up = threading.Thread(target=upstream, name="ssh-forward-up", daemon=True)
        up.start()
        try:
            while not (done.is_set() or self.stopped.is_set()):
                try:
                    data = chan.recv(65536)
                except socket.timeout:
                    continue
                if not data:
                    break
                client.sendall(data)
        except (OSError, EOFError):
            pass
        finally:
            done.set()
            try:
                client.shutdown(socket.SHUT_RDWR)  # wakes the upstream thread's read
            except OSError:
                pass
            up.join(1.0)
            chan.close()
            client.close()

    def close(self) -> None:
        self.stopped.set()
        self.sock.close()
        self.thread.join(2)
        self.transport.logger.removeFilter(self._quiet)


class _RefusedChannels(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Secsh channel") and "open FAILED" in msg)


def describe(handle: ServiceHandle) -> str:
    return json.dumps({"endpoint": handle.endpoint, "host": handle.host, "release": handle.release})
