"""Putting a release into service without an outage: start it beside the one serving, check it, switch.

On the host a deployment's port belongs to its front (v100plan/remote/front.py), a forwarder
that sends each new connection to the release named in run/upstream.json. Releases run in
two slots (run/a, run/b), each on a port of its own. Bringing a release up:

1. the front listens on the deployment's port (started if it is not; a port another program
   holds fails here, before anything else is touched, with the front's `Address already in use`);
2. the release starts in the slot the serving one does not use, on a free port;
3. /health is awaited while its processes are watched (a proxy that exits ends the wait at
   once), then one smoke completion;
4. only then: upstream.json is replaced (the switch: new connections go to the new release),
   `current` is switched; the old release drains: it answers what it holds (its running and
   queued requests, by its /metrics) until they are done, up to ``--drain-timeout`` (default
   DRAIN_TIMEOUT_S), and is stopped only then (new requests it gets are refused from the stop on).

A failure at 2-3 stops the new release; the old one never stopped serving. ``stop-start``
(GPU hosts whose cards cannot hold the new release beside the old one, as v100plan/remote/room.py
measures, and qualify's fresh runs) stops the old release before step 2: the outage is named in the output.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from v100plan.errors import ChecksFailed
from v100plan.remote import release as rel
from v100plan.remote.connect import Remote
from v100plan.remote.host import RemoteSettings, agent
from v100plan.remote.supervisor import (
    DRAIN_TIMEOUT_S,
    KEEP_RELEASES,
    Paths,
    Say,
    serve_flags,
    start_service,
    stop_service,
    switch,
)

FRONT_SOURCE = (Path(__file__).resolve().parent / "front.py").read_text()
SLOTS = ("a", "b")
MODES = ("blue-green", "stop-start")


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block is done (the switch: upstream, `current`, the old release
    stopped), then act: the host is left with one release serving and `current` naming it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda n, _f: got.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if got:
            raise KeyboardInterrupt


def ensure_front(remote: Remote, rs: RemoteSettings, paths: Paths, port: int) -> dict[str, Any]:
    doc = agent(remote, rs, "front", {"run": paths.run, "port": port, "source": FRONT_SOURCE})
    if not doc.get("running"):
        raise ChecksFailed(f"{remote.label}: the service cannot listen on 127.0.0.1:{port}: {doc.get('error')}",
                           hint=f"another program holds port {port} on the host (`ss -ltnp 'sport = :{port}'` "
                                "there names it); deploy with another --port, or stop that program")
    return doc


def _drain(remote: Remote, rs: RemoteSettings, paths: Paths, old_rid: str, old_port: int | None,
           timeout_s: float, say: Say, record: dict[str, Any] | None) -> None:
    """Wait (on the host) until the old release has answered what it holds, up to ``timeout_s``; a Ctrl-C
    ends the wait (the stop that follows gives what is left its own 10 s)."""
    if not old_port or timeout_s <= 0:
        return
    try:
        doc = agent(remote, rs, "drain", {"port": old_port, "key_file": paths.key, "timeout": timeout_s},
                    timeout_s=timeout_s + 60)
    except KeyboardInterrupt:
        say(f"interrupted: stopping release {old_rid} without waiting for its answers")
        return
    if record is not None:
        record["drain"] = {"release": old_rid, **doc}
    if doc.get("waited_s", 0) >= 1 or not doc.get("drained"):
        say(f"release {old_rid} answered what it held in {doc.get('waited_s')} s" if doc.get("drained") else
            f"release {old_rid} still held {doc.get('left')} request(s) after --drain-timeout {timeout_s:g} s: "
            "they end with 503")


def bring_up(remote: Remote, rs: RemoteSettings, paths: Paths, st: dict[str, Any], rid: str,
             settings: rel.EngineSettings, health_timeout_s: float, say: Say, why: str, *,
             mode: str = "blue-green", old_settings: rel.EngineSettings | None = None,
             record: dict[str, Any] | None = None, drain_timeout_s: float = DRAIN_TIMEOUT_S,
             keep: int = KEEP_RELEASES) -> tuple[bool, str | None]:
    """Put ``rid`` into service (the module's steps). (True, None) once it serves and `current` names it;
    (False, why) when it failed its checks, with the release serving before still serving (restarted, in
    stop-start mode). ``old_settings``: the serving release's, to start it again after a failed stop-start.
    ``record`` (the command's JSON extras) gets ``after_reboot``: what brings the release back after a reboot."""
    live = st.get("live") or {}
    old_rid = live.get("release")
    old_slot = live.get("slot")
    old_dir = paths.slot(old_slot) if old_slot else None
    old_front = st.get("front")
    if st.get("legacy") and st.get("current"):
        say(f"stopping release {st['current']}, started by an earlier v100plan in {paths.run} itself (one outage "
            "now; later deploys start the new release beside the old one)")
        stop_service(remote, paths, st["current"], paths.run)
    front = ensure_front(remote, rs, paths, settings.port)
    if mode == "stop-start" and old_rid and old_dir:
        say(f"stopping release {old_rid} first: the service is down until {rid} passes /health")
        stop_service(remote, paths, old_rid, old_dir)
    slot = next(s for s in SLOTS if s != old_slot)
    sdir = paths.slot(slot)
    try:
        busy = agent(remote, rs, "slot_prepare", {"slot": sdir, "release": rid}).get("busy")
        if busy:  # what an interrupted deploy left there: never the serving release (that is the other slot)
            stop_service(remote, paths, rid, sdir)
            agent(remote, rs, "slot_prepare", {"slot": sdir, "release": rid})
        port = agent(remote, rs, "free_port", {})["port"]
        ok, reason = start_service(remote, rs, paths, rid, settings, health_timeout_s, sdir, port)
    except KeyboardInterrupt:
        with shielded():
            say(f"interrupted: stopping release {rid} (not switched to)" +
                (f"; release {old_rid} keeps serving" if old_rid and mode != "stop-start" else ""))
            stop_service(remote, paths, rid, sdir)
            if mode == "stop-start" and old_rid and old_dir and old_settings:
                start_service(remote, rs, paths, old_rid, old_settings, health_timeout_s, old_dir, live["port"])
        raise
    if not ok:
        stop_service(remote, paths, rid, sdir)
        if mode == "stop-start" and old_rid and old_dir and old_settings:
            say(f"release {rid} failed its checks; starting release {old_rid} again")
            ok_old, why_old = start_service(remote, rs, paths, old_rid, old_settings, health_timeout_s, old_dir,
                                            live["port"])
            if not ok_old:
                reason = f"{reason}; release {old_rid} did not come back either ({why_old})"
        return False, reason
    with shielded():
        agent(remote, rs, "route", {"run": paths.run, "port": port, "release": rid, "slot": slot})
        switch(remote, rs, paths, rid, why, from_release=old_rid if why.startswith("rollback") else None, keep=keep)
    draining = old_rid and old_dir and mode != "stop-start"
    if draining:
        _drain(remote, rs, paths, old_rid, live.get("port"), drain_timeout_s, say, record)
    with shielded():
        if draining:
            stop_service(remote, paths, old_rid, old_dir)
        if front.get("replaced") or (old_front and old_front.get("port") != settings.port):
            agent(remote, rs, "front_stop", {"run": paths.run, "front": front.get("replaced") or old_front})
    if why not in ("deploy", "rollback", "rollback --to", "key rotation"):
        return True, None  # qualify's own deployment is stopped when it ends: nothing to bring back
    rdir = paths.release(rid)
    boot = agent(remote, rs, "boot", {"run": paths.run, "port": settings.port, "release": rid, "slot": sdir,
                                      "release_dir": rdir, "flags": serve_flags(paths, rid, settings, sdir, port)})
    if record is not None:
        record["after_reboot"] = boot.get("boot")
        record["after_reboot_detail"] = boot.get("unit") or (boot.get("entry") if boot.get("boot") else boot.get("why"))
    say(f"after a reboot: the {boot['boot']} {boot.get('unit') or 'line'} runs {boot['script']}"
        + (f" ({boot['why_not_unit']})" if boot.get("why_not_unit") else "") if boot.get("boot") else
        f"after a reboot: nothing brings the service back ({boot.get('why')})")
    return True, None
