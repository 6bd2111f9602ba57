"""The pieces every remote deploy command shares: where a deployment lives on the host, its lock,
and the engine's supervisor driven over SSH (start with /health and a smoke completion, status, stop).
"""

from __future__ import annotations

import contextlib
import json
import shlex
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from v100plan.errors import EnvironmentProblem
from v100plan.remote import release as rel
from v100plan.remote.connect import Remote, SshOptions
from v100plan.remote.host import AGENT_SOURCE, RemoteSettings, agent
from v100plan.remote.hosts import HostSpec

KEEP_RELEASES = 5
# How long a switch lets the old release finish what it is answering (docs/deploy.md, "Draining"): a
# 4,096-token answer at 14 tok/s, half the slowest two-V100 figure of the 27B model in docs/field-figures.md
# (27.3 tok/s at 186K context).
DRAIN_TIMEOUT_S = 300.0
Say = Callable[[str], None]


class DeployBusy(EnvironmentProblem):
    """Another deploy, rollback or stop holds the deployment's lock on that host."""


@dataclass(frozen=True)
class Target:
    spec: HostSpec
    ssh: SshOptions
    remote: RemoteSettings
    deployment: str = "engine"
    drain_timeout_s: float = DRAIN_TIMEOUT_S  # a switch: how long the old release may finish its answers
    keep_releases: int = KEEP_RELEASES        # releases kept on the host (the current one among them)


@dataclass(frozen=True)
class Paths:
    root: str
    name: str

    @property
    def dir(self) -> str:
        return f"{self.root}/{self.name}"

    def release(self, rid: str) -> str:
        return f"{self.dir}/releases/{rid}"

    @property
    def run(self) -> str:
        return f"{self.dir}/run"

    @property
    def key(self) -> str:
        return f"{self.dir}/api_key"

    @property
    def models(self) -> str:
        """The host's model store, shared by every deployment under the root: one entry per set of shard
        files (named by the digest of their SHA-256s), which releases link to."""
        return f"{self.root}/models"

    def model(self, digest: str) -> str:
        return f"{self.models}/{digest}"

    def model_partial(self, digest: str) -> str:
        """Where this deployment uploads an entry the store lacks (hidden: never an entry until every file
        matched its SHA-256; then renamed into place)."""
        return f"{self.models}/.partial/{digest}-{self.name}"

    def slot(self, name: str) -> str:
        """A slot's state dir (run/a or run/b): supervisord's files, service.json and logs of the release
        that runs there. Two slots, so a new release starts beside the one serving (blue/green)."""
        return f"{self.run}/{name}"

    def live_slot(self, st: dict[str, Any]) -> str | None:
        """The state dir of the release the front serves now (the agent's ``state``: ``live``), else None."""
        live = st.get("live") or {}
        return self.slot(live["slot"]) if live.get("slot") else None

    @property
    def lock(self) -> str:
        return f"{self.dir}/deploy.lock"


@dataclass
class Outcome:
    host: str
    deployment: str
    action: str
    release: str | None = None
    previous: str | None = None
    changed: bool = False
    restarted: bool = False
    uploaded_bytes: int = 0
    rolled_back: bool = False
    reason: str | None = None
    settings: dict[str, Any] | None = None
    chose: str | None = None
    dry_run: bool = False
    actions: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = document(f"{self.action}_outcome", {"host": self.host, "deployment": self.deployment})
        d.update({k: v for k, v in self.__dict__.items() if k not in ("extra", "started")})
        d.update(self.extra)
        d["wall_s"] = round(self.wall_s, 3)
        return d


def document(kind: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """The head every remote command's --json document starts with: kind, schema_version, provenance."""
    from profiles.document import stamp

    return stamp(kind, inputs)



@contextlib.contextmanager
def held_lock(remote: Remote, settings: RemoteSettings, path: str, what: str) -> Iterator[None]:
    """Hold the deployment's flock on the host for as long as this block runs (the agent keeps it until
    the SSH channel closes, so a crashed deploy never leaves it taken)."""
    info = f"{what} by {rel.local_user()}@{socket.gethostname()} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    chan = remote.open().client.get_transport().open_session()
    chan.exec_command(shlex.join([settings.python, "-c", AGENT_SOURCE, "lock",
                                  json.dumps({"path": path, "info": info})]))
    chan.settimeout(remote.options.connect_timeout_s + 30)
    try:
        line = chan.makefile("r").readline()
        doc = json.loads(line) if line.strip() else {}
    except (OSError, ValueError):
        doc = {}
    if not doc.get("locked"):
        chan.close()
        if "holder" in doc:
            raise DeployBusy(f"{remote.label}: another operation holds {path}: {doc['holder']}",
                             hint="wait for it to finish; the lock goes away when its SSH session ends")
        raise EnvironmentProblem(f"{remote.label}: could not take the deploy lock {path}",
                                 hint="check the remote root is writable and --remote-python runs there")
    try:
        yield
    finally:
        with contextlib.suppress(OSError, EOFError):
            chan.shutdown_write()
        chan.close()


def switch(remote: Remote, rs: RemoteSettings, paths: Paths, release: str, why: str,
           from_release: str | None = None, keep: int = KEEP_RELEASES) -> dict[str, Any]:
    """Make ``release`` current (atomically, on the host) and drop releases beyond the last ``keep``.
    ``from_release``: the release a rollback leaves (recorded, so the next rollback walks further back)."""
    return agent(remote, rs, "switch", {"dep": paths.dir, "release": release, "why": why, "keep": keep,
                                        "from": from_release})


def run_engine(remote: Remote, release_dir: str, args: list[str], timeout_s: float | None = -1,
            env: dict[str, str] | None = None):
    return remote.run([f"{release_dir}/venv/bin/python", "-m", "engine", *args], cwd=release_dir,
                      check=False, timeout_s=timeout_s, what="python -m engine " + " ".join(args[:2]), env=env)


def parse_json(text: str) -> dict[str, Any]:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {}


def supervise_status(remote: Remote, paths: Paths, release: str | None, state_dir: str | None,
                     dry_run: bool = False) -> dict[str, Any]:
    if not release or not state_dir:
        return {"running": False}
    r = run_engine(remote, paths.release(release), ["supervise", "status", "--state-dir", state_dir],
                env={"PYTHONDONTWRITEBYTECODE": "1"} if dry_run else None)
    return parse_json(r.stdout) or {"running": False, "error": r.stderr.strip()[-300:]}


def healthy(remote: Remote, rs: RemoteSettings, paths: Paths, st: dict[str, Any], release: str, port: int,
            dry_run: bool = False) -> bool:
    """The front serves ``release``, its supervisor runs it and /health through the front answers 200
    (asked patiently: a busy host is slow)."""
    live = st.get("live") or {}
    if not st.get("front") or live.get("release") != release or st["front"].get("port") != port:
        return False
    sup = supervise_status(remote, paths, release, paths.live_slot(st), dry_run=dry_run)
    if not sup.get("running"):
        return False
    return agent(remote, rs, "health", {"port": port}).get("status") == 200


def stop_service(remote: Remote, paths: Paths, release: str, state_dir: str) -> dict[str, Any]:
    """Stop the supervisord of ``state_dir`` (a slot) and every process it recorded, with ``release``'s venv."""
    r = run_engine(remote, paths.release(release), ["supervise", "stop", "--state-dir", state_dir])
    doc = parse_json(r.stdout)
    if r.exit_code != 0 and not doc:
        raise EnvironmentProblem(f"{remote.label}: stopping the service failed: {r.stderr.strip()[-500:]}",
                                 hint=f"look at {state_dir}/logs on the host")
    return doc


def serve_flags(paths: Paths, release: str, settings: rel.EngineSettings, state_dir: str, port: int) -> list[str]:
    """`serve`'s flags for ``release`` in the slot ``state_dir``, listening on its own ``port``."""
    return replace(settings, port=port).serve_flags(f"{paths.release(release)}/model", paths.key,
                                                    log_file=f"{state_dir}/service.log")


def start_service(remote: Remote, rs: RemoteSettings, paths: Paths, release: str, settings: rel.EngineSettings,
                  health_timeout_s: float, state_dir: str, port: int) -> tuple[bool, str | None]:
    """Start ``release`` under the supervisor of ``state_dir`` on 127.0.0.1:``port`` (its own port, behind
    the front), wait for /health while watching its processes (the proxy's first exit ends the wait at once,
    with the cause from its log), then send one smoke completion. (True, None) when both passed, else
    (False, why)."""
    rdir = paths.release(release)
    flags = serve_flags(paths, release, settings, state_dir, port)
    r = run_engine(remote, rdir, ["supervise", "start", "--state-dir", state_dir, "--wait-healthy-s", "0",
                                  "--", *flags])
    if r.exit_code != 0:
        return False, f"the supervisor did not start: {r.stderr.strip()[-600:]}"
    doc = agent(remote, rs, "await_health", {"slot": state_dir, "port": port, "timeout": health_timeout_s},
                timeout_s=health_timeout_s + 60)
    if not doc.get("ok"):
        tail = "\n  ".join(doc.get("tail") or [])
        tail = f"\nserve.stderr.log (last lines):\n  {tail}" if tail else ""
        if doc.get("exited"):
            return False, (f"{doc.get('cause') or doc.get('event')} (the new release's proxy ended "
                           f"{doc['seconds']:g} s into the health wait: {doc.get('event')}){tail}")
        return False, f"/health did not pass within {health_timeout_s:g} s ({doc.get('cause')}){tail}"
    return smoke(remote, rs, paths, port)


def smoke(remote: Remote, rs: RemoteSettings, paths: Paths, port: int) -> tuple[bool, str | None]:
    doc = agent(remote, rs, "smoke", {"port": port, "key_file": paths.key})
    return (True, None) if doc.get("ok") else (False, f"smoke completion failed: {doc.get('reason')}")


def settings_of(manifest: dict[str, Any] | None) -> rel.EngineSettings | None:
    if not manifest:
        return None
    return rel.EngineSettings(**manifest["engine"])


@contextlib.contextmanager
def session(target: Target, out: Outcome | None = None, **state: str) -> Iterator[tuple[Remote, dict, Paths]]:
    """One SSH connection to the target's host, what the agent's read-only ``state`` finds of its
    deployment there (``state`` adds the bundle, venv or model ids to look for), and its paths.
    ``out`` gets the wall time since it was made and the bytes uploaded, however the block ends."""
    remote = Remote(target.spec, target.ssh)
    try:
        remote.open()
        st = agent(remote, target.remote, "state", {"root": target.remote.root, "dep": target.deployment, **state})
        yield remote, st, Paths(st["root"], target.deployment)
    finally:
        if out is not None:
            out.uploaded_bytes = remote.bytes_sent
            out.wall_s = time.perf_counter() - out.started
        remote.close()

