"""Managing a deployed release: rollback, status, logs (tail or follow) and stop."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from v100plan.errors import ChecksFailed, EnvironmentProblem
from v100plan.remote import release as rel
from v100plan.remote.host import agent
from v100plan.remote.supervisor import (
    KEEP_RELEASES,
    Outcome,
    Paths,
    Say,
    Target,
    close_target,
    connect_target,
    held_lock,
    settings_of,
    start_service,
    stop_service,
    supervise_status,
)


def rollback(target: Target, health_timeout_s: float = 180.0, say: Say = lambda s: None) -> Outcome:
    t0 = time.perf_counter()
    out = Outcome(host=target.spec.label, deployment=target.deployment, action="rollback")
    remote = connect_target(target)
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
                cur_settings = settings_of(st.get("current_manifest"))
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
        close_target(remote)


def status(target: Target) -> dict[str, Any]:
    remote = connect_target(target)
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
        close_target(remote)


LOG_FILES = ("logs/serve.stderr.log", "logs/serve.stdout.log", "service.log", "logs/supervisord.log")


def logs(target: Target, lines: int = 50) -> dict[str, Any]:
    remote = connect_target(target)
    try:
        st = agent(remote, target.remote, "state", {"root": target.remote.root, "dep": target.deployment})
        paths = Paths(st["root"], target.deployment)
        return agent(remote, target.remote, "logs", {"run": paths.run, "files": list(LOG_FILES), "lines": lines})
    finally:
        close_target(remote)


def follow_logs(target: Target, on_line: Callable[[str], None], lines: int = 20) -> int:
    remote = connect_target(target)
    try:
        st = agent(remote, target.remote, "state", {"root": target.remote.root, "dep": target.deployment})
        paths = Paths(st["root"], target.deployment)
        return remote.stream(["tail", "-n", str(lines), "-F", *(f"{paths.run}/{f}" for f in LOG_FILES[:2])],
                             on_line)
    finally:
        close_target(remote)


def stop(target: Target, say: Say = lambda s: None) -> Outcome:
    t0 = time.perf_counter()
    out = Outcome(host=target.spec.label, deployment=target.deployment, action="stop")
    remote = connect_target(target)
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
        close_target(remote)
