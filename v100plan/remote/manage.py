"""Managing a deployed release: rollback, status, logs (tail or follow) and stop."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from v100plan.errors import BadInput, ChecksFailed, EnvironmentProblem
from v100plan.remote import bluegreen as bg
from v100plan.remote import room
from v100plan.remote import supervisor as sv
from v100plan.remote.host import agent
from v100plan.remote.supervisor import Outcome, Say, Target, session


def rollback_candidates(st: dict[str, Any]) -> list[str]:
    """Releases a rollback can go to, the most recent first: those that were current before (and are still
    on the host), less the ones that plain rollbacks in a row have left, so rollback after rollback walks
    back. A `rollback --to` is a jump, not a step: the walk starts again after it (its release and the one
    it left are candidates again)."""
    hist = st.get("history", [])
    left = set()
    for h in reversed(hist):
        if h.get("why") != "rollback":  # a deploy, or a `rollback --to` ("rollback --to")
            break
        if h.get("from"):
            left.add(h["from"])
    current = st.get("current")
    return [h["release"] for h in reversed(hist) if h["release"] != current and h["release"] not in left
            and h["release"] in st.get("releases", [])]


def _rollback_switch(remote, paths, prev: str, current: str, settings, switch_mode: str) -> room.Switch:  # noqa: ANN001
    """The switch for a rollback: the host's cards (when it has any) against what release ``prev`` holds per
    rank (its model's config and shard manifest, read on the host); a release whose model files are not
    there to read (an older layout) is judged as when nothing was measured."""
    if switch_mode == "stop-start":
        return room.choose(switch_mode, settings, None, "", None, current, remote.label)
    cards, found = room.host_cards(remote)
    need = None
    if cards is not None:
        model = f"{paths.release(prev)}/model"
        try:
            cfg = json.loads(remote.read_text(f"{model}/rank0/config.json"))
            per_rank = [int(b) for b in json.loads(remote.read_text(f"{model}/shard.json"))["bytes_per_rank"]]
        except (OSError, ValueError, KeyError, TypeError):
            cards, found = None, f"release {prev}'s model files were not readable"
        else:
            need = room.rank_need_bytes(cfg, settings, per_rank)
    return room.choose(switch_mode, settings, cards, found, need, current, remote.label)


def rollback(target: Target, health_timeout_s: float = 180.0, say: Say = lambda s: None,
             to: str | None = None, switch_mode: str = "auto") -> Outcome:
    """Back to the release before this one (``to``: a release id, or a unique prefix, still on the host)."""
    out = Outcome(host=target.spec.label, deployment=target.deployment, action="rollback")
    with session(target, out) as (remote, st, paths):
        current = st.get("current")
        older = rollback_candidates(st)
        if to is not None:
            hits = [r for r in st.get("releases", []) if r.startswith(to) and "." not in r]
            if len(hits) != 1:
                raise BadInput(f"{remote.label}: --to {to!r} names {'no' if not hits else 'more than one'} release "
                               f"of {target.deployment!r}", hint=f"`v100plan status {remote.label}` lists them: "
                                                                 f"{', '.join(st.get('releases', [])) or 'none'}")
            if hits[0] == current:
                raise BadInput(f"{remote.label}: release {current} is already current", hint="nothing to roll back")
            older = hits
        if not current or not older:
            raise ChecksFailed(f"{remote.label}: no previous release of {target.deployment!r} to roll back to",
                               hint=f"`v100plan status {remote.label}` lists the releases there")
        prev = older[0]
        out.release, out.previous = prev, current
        with sv.held_lock(remote, target.remote, paths.lock, f"rollback to {prev}"):
            settings = sv.settings_of(json.loads(remote.read_text(f"{paths.release(prev)}/manifest.json")))
            sw = _rollback_switch(remote, paths, prev, current, settings, switch_mode)
            out.extra["switch"] = sw.to_dict()
            mode = sw.mode
            say(f"starting release {prev}" + (f" beside release {current}, which keeps serving until it passes"
                                              if mode == "blue-green" else "") + "; waiting for /health")
            ok, why = bg.bring_up(remote, target.remote, paths, st, prev, settings, health_timeout_s, say,
                                  "rollback" if to is None else "rollback --to", mode=mode, old_settings=sv.settings_of(st.get("current_manifest")),
                                  record=out.extra, drain_timeout_s=target.drain_timeout_s,
                              keep=target.keep_releases)
            out.restarted = True
            if not ok:
                raise ChecksFailed(f"{remote.label}: release {prev} failed its checks ({why}); release {current} "
                                   "is still current and serving", hint=f"`v100plan logs {remote.label}`")
            out.changed = True
            say(f"rolled back: release {prev} is current (release {current} kept)")
        return out


def key_show(target: Target) -> dict[str, Any]:
    """The deployment's API key, read from its file on the host (0600 there)."""
    with session(target) as (remote, st, paths):
        if not st.get("api_key"):
            raise BadInput(f"{remote.label}: deployment {target.deployment!r} has no API key yet",
                           hint=f"`v100plan deploy {remote.label}` makes one")
        return {**sv.document("api_key", {"host": target.spec.label, "deployment": target.deployment}),
                "host": target.spec.label, "deployment": target.deployment, "key_file": paths.key,
                "key": remote.read_text(paths.key).strip()}


def key_rotate(target: Target, health_timeout_s: float = 180.0, say: Say = lambda s: None) -> Outcome:
    """A new API key on the host, in force at once: the service reads its key when it starts, so the current
    release is started afresh beside itself with the new key and takes over as a deploy does (blue/green, no
    failed request; the old processes drain their answers, then stop, and with them the old key). Nothing is
    uploaded; the front keeps its port."""
    out = Outcome(host=target.spec.label, deployment=target.deployment, action="key_rotate")
    with session(target, out) as (remote, st, paths):
        current = st.get("current")
        if not current or not st.get("api_key"):
            raise BadInput(f"{remote.label}: deployment {target.deployment!r} has no current release and key",
                           hint=f"`v100plan deploy {remote.label}` first")
        out.release = out.previous = current
        with sv.held_lock(remote, target.remote, paths.lock, "key rotation"):
            agent(remote, target.remote, "keygen", {"path": paths.key, "replace": True})
            say(f"new API key written to {paths.key} (0600); starting release {current} afresh with it")
            if not (st.get("live") or {}).get("release"):
                out.reason = "the service was not running: the new key is used when it starts"
                return out
            settings = sv.settings_of(st.get("current_manifest"))
            ok, why = bg.bring_up(remote, target.remote, paths, st, current, settings, health_timeout_s, say,
                                  "key rotation", record=out.extra, drain_timeout_s=target.drain_timeout_s,
                                  keep=target.keep_releases)
            out.restarted = True
            if not ok:
                raise ChecksFailed(f"{remote.label}: release {current} did not start with the new key ({why}); the "
                                   "old processes serve on with the old key", hint="run `v100plan key rotate` again")
            agent(remote, target.remote, "unlink", {"dir": paths.dir, "files": ["api_key.previous"]})
            out.changed = True
        return out


def status(target: Target) -> dict[str, Any]:
    with session(target, site="1") as (remote, st, paths):
        current = st.get("current")
        doc: dict[str, Any] = {**sv.document("deployment_status", {"host": target.spec.label,
                                                                   "deployment": target.deployment}),
                               "host": target.spec.label, "deployment": target.deployment, "root": paths.dir,
                               "release": current,
                               # releases that were current (rollback can go there); a release that never was
                               # (its start cut short) is listed apart
                               "releases": [r for r in st.get("releases", []) if r == current or
                                            any(h.get("release") == r for h in st.get("history", []))],
                               "never_current": [r for r in st.get("releases", []) if r != current and not
                                                 any(h.get("release") == r for h in st.get("history", []))],
                               "history": st.get("history", [])}
        if not st.get("exists"):
            there = st.get("deployments") or []
            if there:  # a name that is not there, next to ones that are: a typo, said so (exit 2)
                raise BadInput(f"{remote.label}: no deployment {target.deployment!r} under {paths.root}",
                               hint=f"deployments there: {', '.join(there)} (give one with -d/--deployment)")
            doc["state"] = "not deployed"
            return doc
        live = st.get("live") or {}
        sup = sv.supervise_status(remote, paths, live.get("release") or current, paths.live_slot(st))
        man = st.get("current_manifest") or {}
        front = st.get("front")
        if sup.get("running") and front and man.get("engine"):
            h = agent(remote, target.remote, "health", {"port": front["port"], "key_file": paths.key})  # patiently
            sup["health_status"], sup["health"] = h.get("status"), h.get("body") or sup.get("health")
        elif not front:
            sup["health_status"] = None  # nothing serves the deployment's port
        health = sup.get("health") if isinstance(sup.get("health"), dict) else {}
        uptime = None
        if sup.get("proxy_pid"):
            r = remote.run(["ps", "-o", "etimes=", "-p", str(int(sup["proxy_pid"]))], check=False, what="ps")
            uptime = int(r.stdout.strip()) if r.stdout.strip().isdigit() else None
        procs = _processes({**sup, "ranks_alive": st.get("ranks_alive")}, st.get("front_processes"))
        down = sorted(k for k, p in procs.items() if not p["alive"])
        state = "healthy" if sup.get("health_status") == 200 else ("running" if sup.get("running") else "stopped")
        if down and any(p["alive"] for p in procs.values()):
            state = "degraded"  # some of its processes run, one that should does not: said, and exit 1
        doc.update({
            "state": state, "processes": procs, "down": down,
            "health_status": sup.get("health_status"), "health": health,
            "ranks": [p["pid"] for k, p in procs.items() if k.startswith("rank") and p["alive"]],
            "allreduce": health.get("allreduce"), "generation": sup.get("generation"),
            "uptime_s": uptime, "supervisord_pid": sup.get("supervisord_pid"), "proxy_pid": sup.get("proxy_pid"),
            "engine": man.get("engine"), "port": (man.get("engine") or {}).get("port"),
            # where the settings came from (a plan, the probe, flags); a release made before this was kept has none
            "origin": man.get("origin"),
            # None: an isolated venv; else what the venv takes from the host's site (--remote-site-packages)
            "site_packages": st.get("current_venv_from_site"),
            "front": front, "serving": live or None, "lock_holder": st.get("lock"),
            # "systemd user unit", "cron @reboot", or None: nothing brings it back
            "after_reboot": st.get("boot"),
        })
        if doc["state"] != "healthy" and st.get("lock"):
            doc["state"] = f"busy: {st['lock']}"  # a deploy, rollback or stop at work (it holds the lock)
        return doc


def status_rows(doc: dict[str, Any]) -> list[tuple[str, Any]]:
    """The status command's table: release, health, processes, the settings the service runs with and where they
    came from (a plan, the probe, flags)."""
    from v100plan.remote.release import origin_sentence, settings_sentence

    rows = [(k, doc.get(k)) for k in ("host", "deployment", "state", "release", "health_status", "ranks",
                                      "allreduce", "generation", "uptime_s", "port", "releases")]
    if doc.get("down"):
        rows.insert(3, ("not running", ", ".join(f"{k} (pid {doc['processes'][k]['pid']})" for k in doc["down"])))
    if doc.get("engine"):
        rows.insert(6, ("settings", settings_sentence(doc["engine"], doc.get("health") or {})))
        rows.insert(7, ("from", origin_sentence(doc.get("origin"))))
    rows.append(("after a reboot", doc.get("after_reboot") or "nothing brings it back"))
    if doc.get("lock_holder"):
        rows.append(("lock held by", doc["lock_holder"]))
    if doc.get("site_packages") is not None:
        rows.append(("from the host's site",
                     ", ".join(f"{p['name']} {p['version']}" for p in doc["site_packages"]) or "nothing"))
    return rows


def _processes(sup: dict[str, Any], front: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Every process the deployment runs, each with its PID and whether that very process runs now: the
    front and its keeper (front.json), the serving slot's supervisord, proxy and ranks (service.json,
    each rank by its recorded start time: a PID reused since is not counted alive)."""
    out: dict[str, dict[str, Any]] = {}
    if front:
        out["front"], out["front_keeper"] = front["front"], front["keeper"]
    if sup.get("running"):
        out["supervisord"] = {"pid": sup.get("supervisord_pid"), "alive": True}
        out["proxy"] = {"pid": sup.get("proxy_pid"), "alive": bool(sup.get("proxy_pid"))}
    alive = sup.get("ranks_alive") or {}
    for i, pid in enumerate(sup.get("rank_pids") or []):
        out[f"rank{i}"] = {"pid": pid, "alive": bool(alive.get(str(pid)))}
    return out


# the proxy's stderr, its structured log (serve --log-file; its stdout stays empty then), the supervisor's;
# `logs` adds each rank's latest log and the front's
LOG_FILES = ("logs/serve.stderr.log", "service.log", "logs/supervisord.log")


def logs(target: Target, lines: int = 50, release: str | None = None) -> dict[str, Any]:
    """The serving release's logs (its slot's), and the front's; ``release``: the logs of where that release
    last ran (a failed start too; an id or its unique start, among the releases the slots name)."""
    with session(target) as (remote, st, paths):
        if release is not None:
            doc = agent(remote, target.remote, "logs", {"run": paths.run, "files": list(LOG_FILES), "lines": lines,
                                                        "rank_logs": True, "release": release})
            if doc.get("found") is None:
                raise BadInput(f"{remote.label}: no logs of release {release!r} in {paths.run} (each slot keeps the "
                               "logs of its last two starts)", hint=f"`v100plan status {remote.label}` lists the "
                                                                   "releases; give the full id")
            doc["release"] = release
            return doc
        doc = agent(remote, target.remote, "logs", {"run": paths.live_slot(st) or paths.run,
                                                    "files": list(LOG_FILES), "lines": lines, "rank_logs": True})
        doc["logs"].update(agent(remote, target.remote, "logs", {"run": paths.run, "files": ["front.log"],
                                                                 "lines": lines})["logs"])
        # the proxy writes its structured events to stderr and to service.log: stderr shows the rest only
        # (tracebacks, warnings), so no event is shown twice
        err = doc["logs"].get("logs/serve.stderr.log")
        if err is not None and doc["logs"].get("service.log") is not None:
            doc["logs"]["logs/serve.stderr.log"] = [ln for ln in err if not ln.startswith('{"ts":')]
        return doc


def follow_logs(target: Target, on_line: Callable[[str], None], lines: int = 20) -> int:
    with session(target) as (remote, st, paths):
        run = paths.live_slot(st) or paths.run
        return remote.stream(["tail", "-n", str(lines), "-F", *(f"{run}/{f}" for f in LOG_FILES[:2])], on_line)


def stop(target: Target, say: Say = lambda s: None, purpose: str | None = None) -> Outcome:
    """Stop the deployment's service. ``purpose`` (qualify's): only a deployment made for that purpose;
    one that `v100plan deploy` made is refused. A deployment whose first release never became current
    (a deploy cut short while it started) is stopped through that release."""
    return _stop(target, say, purpose, remove=False)


def remove(target: Target, say: Say = lambda s: None, venvs: bool = False) -> Outcome:
    """Stop the deployment's service, then delete its directory on the host (releases, logs, key, history)
    and the model store entries no other deployment's release links; ``venvs``: the venvs too that no other
    deployment's release uses."""
    return _stop(target, say, None, remove="venvs" if venvs else True)


def _stop(target: Target, say: Say, purpose: str | None, remove: bool) -> Outcome:
    out = Outcome(host=target.spec.label, deployment=target.deployment, action="remove" if remove else "stop")
    with session(target, out) as (remote, st, paths):
        if purpose and any(h.get("why") == "deploy" for h in st.get("history", [])):
            raise BadInput(f"{remote.label}: deployment {target.deployment!r} was made by `v100plan deploy`; "
                           f"{purpose} stops only its own", hint=f"`v100plan stop {remote.label} --deployment "
                                                                 f"{target.deployment}` stops it by hand")
        if remove and not st.get("exists"):
            there = ", ".join(st.get("deployments") or []) or "none"
            raise BadInput(f"{remote.label}: no deployment {target.deployment!r} under {paths.root}",
                           hint=f"deployments there: {there} (give one with -d/--deployment)")
        unpacked = [r for r in st.get("releases", []) if "." not in r]  # not a .tmp-PID half-unpacked one
        out.release = st.get("current") or (unpacked or [None])[-1]
        if not out.release and not remove:
            out.reason = "nothing deployed"
            return out
        with sv.held_lock(remote, target.remote, paths.lock, "remove" if remove else "stop"):
            stopped, killed, left = {}, [], []
            dirs = [paths.slot(n) for n, up in (st.get("slots") or {}).items() if up]
            if st.get("legacy"):
                dirs.append(paths.run)
            live_slot = paths.live_slot(st)
            if live_slot and live_slot not in dirs:
                dirs.append(live_slot)  # its supervisord gone, its recorded processes perhaps not
            for d in dirs if out.release else []:
                doc = sv.stop_service(remote, paths, out.release, d)
                stopped.update(doc.get("stopped", {}))
                killed += doc.get("had_to_kill", [])
                left += doc.get("left_running", [])
            front = agent(remote, target.remote, "front_stop", {"run": paths.run}).get("stopped")
            agent(remote, target.remote, "boot", {"run": paths.run, "remove": True})  # stopped stays stopped
            if front:
                stopped["front"] = front
            if remove and not left:
                gone = agent(remote, target.remote, "remove_deployment", {"dep": paths.dir,
                                                                          "venvs": remove == "venvs"})
                out.extra["removed"] = gone["removed"]
                out.extra["models_removed"] = gone["models_removed"]
                out.extra["venvs_removed"] = gone.get("venvs_removed", [])
        out.extra["stopped"] = stopped
        out.extra["had_to_kill"] = killed
        if left:
            raise EnvironmentProblem(f"{remote.label}: still running after stop: {left}"
                                     + (" (nothing was removed)" if remove else ""),
                                     hint="look at the host: ps -o pid,pgid,cmd -u $USER")
        if not stopped:
            out.reason = "nothing was running"
        say(f"stopped release {out.release}: " + (", ".join(f"{k} {v}" for k, v in stopped.items())
                                                  or "nothing was running"))
        if remove:
            kept = "" if out.extra["models_removed"] else "; the model store keeps what other deployments link"
            say(f"removed {out.extra['removed']}" + (f" and model(s) {', '.join(out.extra['models_removed'])} from the "
                                                      "store (no release links them)" if out.extra["models_removed"]
                                                      else kept))
        return out
