"""Managing a deployed release: rollback, status, logs (tail or follow) and stop."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from v100plan.errors import BadInput, ChecksFailed, EnvironmentProblem
from v100plan.remote import supervisor as sv
from v100plan.remote.host import agent
from v100plan.remote.supervisor import Outcome, Say, Target, session


def rollback(target: Target, health_timeout_s: float = 180.0, say: Say = lambda s: None) -> Outcome:
    out = Outcome(host=target.spec.label, deployment=target.deployment, action="rollback")
    with session(target, out) as (remote, st, paths):
        current = st.get("current")
        older = [h["release"] for h in st.get("history", []) if h["release"] != current
                 and h["release"] in st.get("releases", [])]
        if not current or not older:
            raise ChecksFailed(f"{remote.label}: no previous release of {target.deployment!r} to roll back to",
                               hint=f"`v100plan status {remote.label}` lists the releases there")
        prev = older[-1]
        out.release, out.previous = prev, current
        with sv.held_lock(remote, target.remote, paths.lock, f"rollback to {prev}"):
            settings = sv.settings_of(json.loads(remote.read_text(f"{paths.release(prev)}/manifest.json")))
            say(f"stopping release {current}")
            sv.stop_service(remote, paths, current)
            say(f"starting release {prev}; waiting for /health")
            ok, why = sv.start_service(remote, target.remote, paths, prev, settings, health_timeout_s)
            out.restarted = True
            if not ok:
                sv.stop_service(remote, paths, prev)
                cur_settings = sv.settings_of(st.get("current_manifest"))
                if cur_settings:
                    sv.start_service(remote, target.remote, paths, current, cur_settings, health_timeout_s)
                raise ChecksFailed(f"{remote.label}: release {prev} failed its checks ({why}); {current} "
                                   "was started again", hint=f"`v100plan logs {remote.label}`")
            sv.switch(remote, target.remote, paths, prev, "rollback")
            out.changed = True
            say(f"rolled back: release {prev} is current (release {current} kept)")
        return out


def status(target: Target) -> dict[str, Any]:
    with session(target, site="1") as (remote, st, paths):
        current = st.get("current")
        doc: dict[str, Any] = {"host": target.spec.label, "deployment": target.deployment, "root": paths.dir,
                               "release": current, "releases": st.get("releases", []),
                               "history": st.get("history", [])}
        if not st.get("exists"):
            doc["state"] = "not deployed"
            return doc
        sup = sv.supervise_status(remote, paths, current)
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
            # None: an isolated venv; else what the venv takes from the host's site (--remote-site-packages)
            "site_packages": st.get("current_venv_from_site"),
        })
        return doc


LOG_FILES = ("logs/serve.stderr.log", "logs/serve.stdout.log", "service.log", "logs/supervisord.log")


def logs(target: Target, lines: int = 50) -> dict[str, Any]:
    with session(target) as (remote, _st, paths):
        return agent(remote, target.remote, "logs", {"run": paths.run, "files": list(LOG_FILES), "lines": lines})


def follow_logs(target: Target, on_line: Callable[[str], None], lines: int = 20) -> int:
    with session(target) as (remote, _st, paths):
        return remote.stream(["tail", "-n", str(lines), "-F", *(f"{paths.run}/{f}" for f in LOG_FILES[:2])],
                             on_line)


def stop(target: Target, say: Say = lambda s: None, purpose: str | None = None) -> Outcome:
    """Stop the deployment's service. ``purpose`` (qualify's): only a deployment made for that purpose;
    one that `v100plan deploy` made is refused. A deployment whose first release never became current
    (a deploy cut short while it started) is stopped through that release."""
    out = Outcome(host=target.spec.label, deployment=target.deployment, action="stop")
    with session(target, out) as (remote, st, paths):
        if purpose and any(h.get("why") == "deploy" for h in st.get("history", [])):
            raise BadInput(f"{remote.label}: deployment {target.deployment!r} was made by `v100plan deploy`; "
                           f"{purpose} stops only its own", hint=f"`v100plan stop {remote.label} --deployment "
                                                                 f"{target.deployment}` stops it by hand")
        unpacked = [r for r in st.get("releases", []) if "." not in r]  # not a .tmp-PID half-unpacked one
        out.release = st.get("current") or (unpacked or [None])[-1]
        if not out.release:
            out.reason = "nothing deployed"
            return out
        with sv.held_lock(remote, target.remote, paths.lock, "stop"):
            doc = sv.stop_service(remote, paths, out.release)
        out.extra["stopped"] = doc.get("stopped", {})
        out.extra["had_to_kill"] = doc.get("had_to_kill", [])
        if doc.get("left_running"):
            raise EnvironmentProblem(f"{remote.label}: still running after stop: {doc['left_running']}",
                                     hint="look at the host: ps -o pid,pgid,cmd -u $USER")
        say(f"stopped release {out.release}: " + (", ".join(f"{k} {v}" for k, v in doc.get("stopped", {}).items())
                                                  or "nothing was running"))
        return out
