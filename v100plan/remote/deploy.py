"""Deploy the bundled engine to a host and manage it there: deploy, rollback, status, logs, stop.

On the host, under the remote root (docs/deploy.md):

    <deployment>/releases/<release-id>/   the bundle unpacked, manifest.json, model -> models/<digest>,
                                          venv -> ../../venvs/<venv-id>
    <deployment>/current -> releases/<id> switched atomically, only after /health and a smoke
                                          completion passed on the new release
    <deployment>/models/<digest>/         model files, each verified by SHA-256 after upload
    <deployment>/run/                     the supervisor's state: supervisord.conf, pid, socket, logs
    <deployment>/api_key                  the service's API key (0600, made on the host, never printed)
    <deployment>/history.json             releases in the order they became current
    <deployment>/deploy.lock              held (flock) by the one deploy, rollback or stop at work

The service runs under the engine's own supervisor (`python -m engine supervise`), which
records the supervisord, proxy and rank PIDs and stops exactly those.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from v100plan.errors import ChecksFailed, EnvironmentProblem, V100planError
from v100plan.remote import bundle as bundle_mod
from v100plan.remote import release as rel
from v100plan.remote import venv as venv_mod
from v100plan.remote.connect import Remote, SshOptions
from v100plan.remote.host import AGENT_SOURCE, RemoteSettings, agent, prepare
from v100plan.remote.hosts import HostSpec

KEEP_RELEASES = 5
Say = Callable[[str], None]


class DeployBusy(EnvironmentProblem):
    """Another deploy, rollback or stop holds the deployment's lock on that host."""


@dataclass(frozen=True)
class Target:
    spec: HostSpec
    ssh: SshOptions
    remote: RemoteSettings
    deployment: str = "engine"


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

    def model(self, digest: str) -> str:
        return f"{self.dir}/models/{digest}"

    @property
    def service_log(self) -> str:
        return f"{self.run}/service.log"

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

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        d["wall_s"] = round(self.wall_s, 3)
        return d


# -- pieces ---------------------------------------------------------------------------------------

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


def _engine(remote: Remote, release_dir: str, args: list[str], timeout_s: float | None = -1,
            env: dict[str, str] | None = None):
    return remote.run([f"{release_dir}/venv/bin/python", "-m", "engine", *args], cwd=release_dir,
                      check=False, timeout_s=timeout_s, what="python -m engine " + " ".join(args[:2]), env=env)


def _json(text: str) -> dict[str, Any]:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {}


def supervise_status(remote: Remote, paths: Paths, release: str | None, dry_run: bool = False) -> dict[str, Any]:
    if not release:
        return {"running": False}
    r = _engine(remote, paths.release(release), ["supervise", "status", "--state-dir", paths.run],
                env={"PYTHONDONTWRITEBYTECODE": "1"} if dry_run else None)
    return _json(r.stdout) or {"running": False, "error": r.stderr.strip()[-300:]}


def healthy(remote: Remote, rs: RemoteSettings, paths: Paths, release: str, port: int,
            dry_run: bool = False) -> bool:
    """The supervisor runs the service and its /health answers 200 (asked patiently: a busy host is slow)."""
    sup = supervise_status(remote, paths, release, dry_run=dry_run)
    if not sup.get("running"):
        return False
    if sup.get("health_status") == 200:
        return True
    return agent(remote, rs, "health", {"port": port}).get("status") == 200


def stop_service(remote: Remote, paths: Paths, release: str) -> dict[str, Any]:
    r = _engine(remote, paths.release(release), ["supervise", "stop", "--state-dir", paths.run])
    doc = _json(r.stdout)
    if r.exit_code != 0 and not doc:
        raise EnvironmentProblem(f"{remote.label}: stopping the service failed: {r.stderr.strip()[-500:]}",
                                 hint=f"look at {paths.run}/logs on the host")
    return doc


def start_service(remote: Remote, rs: RemoteSettings, paths: Paths, release: str, settings: rel.EngineSettings,
                  health_timeout_s: float) -> tuple[bool, str | None]:
    """Start ``release`` under the supervisor and wait for /health; then one smoke completion.
    (True, None) when both passed, else (False, why)."""
    rdir = paths.release(release)
    flags = settings.serve_flags(f"{rdir}/model", paths.key, log_file=paths.service_log)
    r = _engine(remote, rdir, ["supervise", "start", "--state-dir", paths.run,
                               "--wait-healthy-s", f"{health_timeout_s:g}", "--", *flags],
                timeout_s=max(remote.options.command_timeout_s, health_timeout_s + 120))
    if r.exit_code != 0:
        tail = _log_tail(remote, rs, paths)
        return False, f"/health did not pass: {r.stderr.strip()[-600:]}" + (f"\n{tail}" if tail else "")
    return smoke(remote, rs, paths, settings.port)


def smoke(remote: Remote, rs: RemoteSettings, paths: Paths, port: int) -> tuple[bool, str | None]:
    doc = agent(remote, rs, "smoke", {"port": port, "key_file": paths.key})
    return (True, None) if doc.get("ok") else (False, f"smoke completion failed: {doc.get('reason')}")


def _log_tail(remote: Remote, rs: RemoteSettings, paths: Paths, lines: int = 15) -> str:
    try:
        doc = agent(remote, rs, "logs",
                    {"run": paths.run, "files": ["logs/serve.stderr.log"], "lines": lines})
    except V100planError:
        return ""
    text = doc["logs"].get("logs/serve.stderr.log") or []
    return "serve.stderr.log (last lines):\n  " + "\n  ".join(text) if text else ""


def _settings_of(manifest: dict[str, Any] | None) -> rel.EngineSettings | None:
    if not manifest:
        return None
    return rel.EngineSettings(**manifest["engine"])


def _connect(target: Target) -> Remote:
    remote = Remote(target.spec, target.ssh)
    remote.open()
    return remote


def _close(remote: Remote) -> None:
    remote.close()


# -- deploy ---------------------------------------------------------------------------------------

def deploy(target: Target, model_dir: str | Path, settings: rel.EngineSettings, *, dry_run: bool = False,
           health_timeout_s: float = 180.0, say: Say = lambda s: None, chose: str | None = None) -> Outcome:
    t0 = time.perf_counter()
    b = bundle_mod.build()
    reqs = venv_mod.engine_requirements(target.remote.torch)
    vid = venv_mod.venv_id(target.remote.python, reqs, target.remote.index_url)
    files = rel.model_files(model_dir)
    man = rel.manifest(b.sha256, vid, reqs, settings, files)
    rid = rel.release_id(man)
    digest = man["model"]["digest"]
    out = Outcome(host=target.spec.label, deployment=target.deployment, action="deploy", release=rid,
                  settings=settings.pinned(), chose=chose, dry_run=dry_run)
    remote = _connect(target)
    try:
        st = agent(remote, target.remote, "state", {"root": target.remote.root, "dep": target.deployment,
                                                    "bundle": b.id, "venv": vid, "model": digest})
        paths = Paths(st["root"], target.deployment)
        out.previous = st.get("current")
        if dry_run:
            _plan_actions(remote, target.remote, paths, st, b, vid, reqs, files, digest, rid, settings, out)
            for a in out.actions:
                say(f"would: {a}")
            return out
        with held_lock(remote, target.remote, paths.lock, f"deploy of {rid}"):
            _deploy_locked(remote, target, paths, st, b, reqs, model_dir, files, man, rid, settings,
                           health_timeout_s, say, out)
        out.uploaded_bytes = remote.bytes_sent
        return out
    finally:
        out.uploaded_bytes = remote.bytes_sent
        out.wall_s = time.perf_counter() - t0
        _close(remote)


def _plan_actions(remote, rs, paths, st, b, vid, reqs, files, digest, rid, settings, out) -> None:
    acts = out.actions
    if st.get("current") == rid:
        if healthy(remote, rs, paths, rid, settings.port, dry_run=True):
            acts.append(f"nothing: release {rid} is current and healthy (0 bytes to upload, no restart)")
            return
        acts.append(f"start release {rid} again: it is current but its service is down")
        return
    acts.append(f"reuse bundle {b.id}" if st["bundle_tar"] else
                f"upload the bundle ({b.size / 1e3:.0f} kB) to {paths.root}/bundles/{b.id}.tar.gz")
    acts.append(f"reuse venv {vid}" if st["venv"] else
                f"build venv {paths.root}/venvs/{vid} with {' '.join(reqs)}")
    total = sum(f["bytes"] for f in files.values())
    acts.append(f"reuse model {digest} (verified)" if st.get("model") else
                f"upload {len(files)} model file(s), {total / 1e6:.1f} MB, to {paths.model(digest)} and verify "
                "each SHA-256 there")
    if not st.get("api_key"):
        acts.append(f"create the API key file {paths.key} (0600, made on the host)")
    acts.append(f"unpack release {rid} into {paths.release(rid)}")
    if st.get("current"):
        acts.append(f"stop the service of release {st['current']} (recorded PIDs, via the supervisor)")
    acts.append(f"start release {rid} under supervisord on 127.0.0.1:{settings.port} ({settings.device}), "
                "wait for /health, send one smoke completion")
    acts.append(f"switch {paths.dir}/current -> releases/{rid}" +
                (f" (release {st['current']} kept for rollback)" if st.get("current") else ""))
    if st.get("current"):
        acts.append(f"if a check fails: stop {rid} and start {st['current']} again")


def _upload_model(remote: Remote, target: Target, paths: Paths, model_dir: Path, files: dict, digest: str,
                  say: Say, has_rsync: bool) -> None:
    """Model files the host lacks (or holds with another SHA-256): rsync over ssh when both ends have
    rsync, SFTP otherwise; both resume a broken upload. Then every file's SHA-256 is checked there."""
    mdir = paths.model(digest)
    subdirs = sorted({str(Path(f).parent) for f in files if str(Path(f).parent) != "."})
    agent(remote, target.remote, "mkdirs", {"paths": [mdir, *(f"{mdir}/{s}" for s in subdirs)]})
    have = agent(remote, target.remote, "sha256", {"dir": mdir})["files"]
    todo = [f for f in files if have.get(f) != files[f]["sha256"]]
    total = sum(files[f]["bytes"] for f in todo)
    use_rsync = bool(todo) and has_rsync and remote.rsync_command() is not None
    say(f"uploading {len(todo)} model file(s), {total / 1e6:.1f} MB "
        f"({'rsync over ssh' if use_rsync else 'SFTP'}, resumable)")
    if use_rsync:
        remote.rsync(model_dir, mdir, todo)
    else:
        for f in todo:
            remote.upload(model_dir / f, f"{mdir}/{f}")
    got = agent(remote, target.remote, "sha256", {"dir": mdir})["files"]
    bad = [f for f in files if got.get(f) != files[f]["sha256"]]
    if bad:
        raise EnvironmentProblem(f"{remote.label}: model file(s) {', '.join(bad)} do not match their SHA-256 "
                                 "after upload", hint="run the deploy again (it resumes and re-checks)")
    agent(remote, target.remote, "verified", {"dir": mdir})


def _deploy_locked(remote, target, paths, st, b, reqs, model_dir, files, man, rid, settings, health_timeout_s,
                   say, out) -> None:
    current = st.get("current")
    if current == rid:
        if healthy(remote, target.remote, paths, rid, settings.port):
            out.reason = "nothing changed"
            say(f"nothing changed: release {rid} is current and healthy; uploaded 0 bytes, restarted nothing")
            return
        say(f"release {rid} is current but its service is down: starting it")
        ok, why = start_service(remote, target.remote, paths, rid, settings, health_timeout_s)
        out.restarted = True
        if not ok:
            raise ChecksFailed(f"{remote.label}: release {rid} did not come back: {why}",
                               hint=f"`v100plan logs {remote.label}` shows the service's logs")
        return
    prep = prepare(remote, target.remote, reqs, stage=say, bundle=b, unpack=False)
    if not st.get("model"):
        _upload_model(remote, target, paths, Path(model_dir), files,
                      man["model"]["digest"], say, has_rsync=bool(st.get("rsync")))
    agent(remote, target.remote, "keygen", {"path": paths.key})
    agent(remote, target.remote, "mkdirs", {"paths": [f"{paths.dir}/releases", paths.run]})
    agent(remote, target.remote, "extract", {
        "tar": prep.bundle_tar, "dest": paths.release(rid), "manifest": man,
        "links": {"model": f"../../models/{man['model']['digest']}", "venv": prep.venv_dir}})
    if settings.device != "cpu":
        _check_stack(remote, paths, rid)
    out.changed = True
    if current:
        say(f"stopping release {current}")
        stop_service(remote, paths, current)
    say(f"starting release {rid} ({settings.device}, 127.0.0.1:{settings.port}); waiting for /health")
    out.restarted = True
    ok, why = start_service(remote, target.remote, paths, rid, settings, health_timeout_s)
    if ok:
        sw = agent(remote, target.remote, "switch", {"dep": paths.dir, "release": rid, "why": "deploy",
                                                     "keep": KEEP_RELEASES})
        say(f"release {rid} is current" + (f" (previous {current} kept)" if current else ""))
        out.extra["removed_releases"] = sw.get("removed", [])
        return
    out.reason = why
    stop_service(remote, paths, rid)
    agent(remote, target.remote, "discard", {"dep": paths.dir, "release": rid})
    if current:
        prev = _settings_of(st.get("current_manifest")) or settings
        say(f"release {rid} failed its checks; rolling back to {current}")
        ok_prev, why_prev = start_service(remote, target.remote, paths, current, prev, health_timeout_s)
        out.rolled_back = True
        if not ok_prev:
            raise ChecksFailed(f"{remote.label}: release {rid} failed ({why}) and the previous release "
                               f"{current} did not come back either ({why_prev})",
                               hint=f"`v100plan logs {remote.label}` shows both attempts")
        raise ChecksFailed(f"{remote.label}: release {rid} failed its checks and was rolled back to {current}: "
                           f"{why}", hint=f"`v100plan logs {remote.label}` shows the failed start")
    raise ChecksFailed(f"{remote.label}: release {rid} failed its checks (no previous release to roll back to): "
                       f"{why}", hint=f"`v100plan logs {remote.label}` shows the failed start")


def torch_gap(report: dict[str, Any], host: str) -> EnvironmentProblem | None:
    """The error to stop a deploy with when the venv's torch has no kernels for a card (the probe's
    software_stack verdict, per card), else None."""
    bad = [c for c in report.get("cards") or [] if c.get("torch_supported") is False]
    if not bad:
        return None
    info = report.get("host") or {}
    ccs = sorted({c.get("compute_capability") for c in bad if c.get("compute_capability")})
    sms = ", ".join("sm_" + cc.replace(".", "") for cc in ccs)
    return EnvironmentProblem(
        f"{host}: torch {info.get('torch_version')} in the host's venv has no kernels for {sms} "
        f"(its arch list: {', '.join(info.get('torch_arch_list') or [])}); the new release was not started",
        hint="a V100 (sm_70) needs a CUDA 12.x torch build (CUDA 13 builds dropped sm_70): deploy with "
             "--index-url https://download.pytorch.org/whl/cu126 --torch 'torch==<a version built for cu126>'")


def _check_stack(remote: Remote, paths: Paths, rid: str) -> None:
    """On GPUs: the probe's software_stack verdict, run with the release's own torch, decides."""
    rdir = paths.release(rid)
    r = remote.run([f"{rdir}/venv/bin/python", "-m", "probes", "--only", "inventory,software_stack"],
                   cwd=rdir, check=False, what="python -m probes --only software_stack")
    problem = torch_gap(_json(r.stdout), remote.label)
    if problem is not None:
        raise problem


# -- rollback, status, logs, stop -------------------------------------------------------------------

def rollback(target: Target, health_timeout_s: float = 180.0, say: Say = lambda s: None) -> Outcome:
    t0 = time.perf_counter()
    out = Outcome(host=target.spec.label, deployment=target.deployment, action="rollback")
    remote = _connect(target)
    try:
        st = agent(remote, target.remote, "state", {"root": target.remote.root, "dep": target.deployment})
        paths = Paths(st["root"], target.deployment)
        current = st.get("current")
        older = [h["release"] for h in st.get("history", []) if h["release"] != current
                 and h["release"] in st.get("releases", [])]
        if not current or not older:
            raise ChecksFailed(f"{remote.label}: no previous release of {target.deployment!r} to roll back to",
                               hint=f"`v100plan status {remote.label}` lists the releases there")
        prev = older[-1]
        out.release, out.previous = prev, current
        with held_lock(remote, target.remote, paths.lock, f"rollback to {prev}"):
            man = json.loads(remote.read_text(f"{paths.release(prev)}/manifest.json"))
            settings = rel.EngineSettings(**man["engine"])
            say(f"stopping release {current}")
            stop_service(remote, paths, current)
            say(f"starting release {prev}; waiting for /health")
            ok, why = start_service(remote, target.remote, paths, prev, settings, health_timeout_s)
            out.restarted = True
            if not ok:
                stop_service(remote, paths, prev)
                cur_settings = _settings_of(st.get("current_manifest"))
                if cur_settings:
                    start_service(remote, target.remote, paths, current, cur_settings, health_timeout_s)
                raise ChecksFailed(f"{remote.label}: release {prev} failed its checks ({why}); {current} "
                                   "was started again", hint=f"`v100plan logs {remote.label}`")
            agent(remote, target.remote, "switch", {"dep": paths.dir, "release": prev, "why": "rollback",
                                                    "keep": KEEP_RELEASES})
            out.changed = True
            say(f"rolled back: release {prev} is current (release {current} kept)")
        return out
    finally:
        out.wall_s = time.perf_counter() - t0
        _close(remote)


def status(target: Target) -> dict[str, Any]:
    remote = _connect(target)
    try:
        st = agent(remote, target.remote, "state", {"root": target.remote.root, "dep": target.deployment})
        paths = Paths(st["root"], target.deployment)
        current = st.get("current")
        doc: dict[str, Any] = {"host": target.spec.label, "deployment": target.deployment, "root": paths.dir,
                               "release": current, "releases": st.get("releases", []),
                               "history": st.get("history", [])}
        if not st.get("exists"):
            doc["state"] = "not deployed"
            return doc
        sup = supervise_status(remote, paths, current)
        man = st.get("current_manifest") or {}
        if sup.get("running") and sup.get("health_status") != 200 and man.get("engine"):
            h = agent(remote, target.remote, "health", {"port": man["engine"]["port"]})  # patiently
            sup["health_status"], sup["health"] = h.get("status"), h.get("body") or sup.get("health")
        health = sup.get("health") if isinstance(sup.get("health"), dict) else {}
        uptime = None
        if sup.get("proxy_pid"):
            r = remote.run(["ps", "-o", "etimes=", "-p", str(int(sup["proxy_pid"]))], check=False, what="ps")
            uptime = int(r.stdout.strip()) if r.stdout.strip().isdigit() else None
        doc.update({
            "state": "healthy" if sup.get("health_status") == 200 else ("running" if sup.get("running")
                                                                         else "stopped"),
            "health_status": sup.get("health_status"), "health": health,
            "ranks": sup.get("rank_pids") or health.get("rank_pids") or [],
            "allreduce": health.get("allreduce"), "generation": sup.get("generation"),
            "uptime_s": uptime, "supervisord_pid": sup.get("supervisord_pid"), "proxy_pid": sup.get("proxy_pid"),
            "engine": man.get("engine"), "port": (man.get("engine") or {}).get("port"),
        })
        return doc
    finally:
        _close(remote)


LOG_FILES = ("logs/serve.stderr.log", "logs/serve.stdout.log", "service.log", "logs/supervisord.log")


def logs(target: Target, lines: int = 50) -> dict[str, Any]:
    remote = _connect(target)
    try:
        st = agent(remote, target.remote, "state", {"root": target.remote.root, "dep": target.deployment})
        paths = Paths(st["root"], target.deployment)
        return agent(remote, target.remote, "logs", {"run": paths.run, "files": list(LOG_FILES), "lines": lines})
    finally:
        _close(remote)


def follow_logs(target: Target, on_line: Callable[[str], None], lines: int = 20) -> int:
    remote = _connect(target)
    try:
        st = agent(remote, target.remote, "state", {"root": target.remote.root, "dep": target.deployment})
        paths = Paths(st["root"], target.deployment)
        return remote.stream(["tail", "-n", str(lines), "-F", *(f"{paths.run}/{f}" for f in LOG_FILES[:2])],
                             on_line)
    finally:
        _close(remote)


def stop(target: Target, say: Say = lambda s: None) -> Outcome:
    t0 = time.perf_counter()
    out = Outcome(host=target.spec.label, deployment=target.deployment, action="stop")
    remote = _connect(target)
    try:
        st = agent(remote, target.remote, "state", {"root": target.remote.root, "dep": target.deployment})
        paths = Paths(st["root"], target.deployment)
        out.release = st.get("current")
        if not out.release:
            out.reason = "nothing deployed"
            return out
        with held_lock(remote, target.remote, paths.lock, "stop"):
            doc = stop_service(remote, paths, out.release)
        out.extra["stopped"] = doc.get("stopped", {})
        out.extra["had_to_kill"] = doc.get("had_to_kill", [])
        if doc.get("left_running"):
            raise EnvironmentProblem(f"{remote.label}: still running after stop: {doc['left_running']}",
                                     hint="look at the host: ps -o pid,pgid,cmd -u $USER")
        say(f"stopped release {out.release}: " + (", ".join(f"{k} {v}" for k, v in doc.get("stopped", {}).items())
                                                  or "nothing was running"))
        return out
    finally:
        out.wall_s = time.perf_counter() - t0
        _close(remote)
