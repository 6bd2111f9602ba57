"""`python -m engine supervise start|stop|status|unit`: run the service under a real supervisor.

supervisord (the serve extra installs it into the service's own environment; no
root) is the portable default: `start` writes supervisord.conf into the state
directory and starts supervisord, which daemonizes and runs `python -m engine
serve ...` as its one program, restarting it whenever it dies. `unit` prints (or
with --install, installs for the user manager) a systemd unit for hosts that
have systemd. Process tree under supervisord:

    supervisord (daemon, state-dir/supervisord.pid)
    └── python -m engine serve ...           (the proxy; own process group)
        └── python -m engine.service.rank_forks --adopt-socket state-dir/forks.sock
            ├── rank 0 (forked)              (die with the fork server: PR_SET_PDEATHSIG)
            └── rank 1 (forked)

A SIGKILLed proxy's fork server SIGKILLs its ranks and waits for the next proxy, which takes it over
(engine/service/rank_forks.py); without the fork server (--no-standby-ranks) the ranks are the proxy's
children and die with it.

`stop` shuts supervisord down: it sends SIGTERM to the proxy alone, which drains, stops its
watchdog and only then its ranks (signalling the whole group at once made the watchdog see
its ranks die and start a new generation mid-shutdown); whatever is left after
stopwaitsecs is SIGKILLed as a group. Then `stop` checks that the proxy and both ranks are
gone, SIGKILLs any straggler and says so. The default state directory is per port
(default_state_dir), so two instances never share one.
Every subcommand prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import engine
from engine.service.serve_config import (
    FINAL_EXITS,
    ServeConfigError,
    add_serve_arguments,
    config_from_args,
    default_state_dir,
)
from engine.service.state_dir import (
    ID_ENV,
    StateDirError,
    carries_id,
    check_state_dir,
    is_same_process,
    make_state_dir,
    service_id,
    start_time,
)

PROGRAM = "engine"
# The directory that holds the engine package: supervisord and systemd start `-m engine` from there.
BUNDLE_ROOT = str(engine.BUNDLE_ROOT)


class SuperviseError(Exception):
    pass


def _conf_value(text: str) -> str:
    return text.replace("%", "%%")  # supervisord expands %(name)s in values


def serve_command(serve_args: list[str], state_dir: str) -> list[str]:
    """Validate the serve flags now (a typo fails here, not in a restart loop) and pin the state dir."""
    parser = argparse.ArgumentParser(prog="python -m engine serve")
    add_serve_arguments(parser)
    try:
        args = parser.parse_args(serve_args)
    except SystemExit:
        raise SuperviseError("the serve flags after `--` are not valid (see the message above)") from None
    args.state_dir = state_dir
    try:
        config_from_args(args)
    except ServeConfigError as exc:
        raise SuperviseError(str(exc)) from None
    cleaned = []
    skip = False
    for i, a in enumerate(serve_args):  # drop any --state-dir the user gave; we pass ours
        if skip:
            skip = False
            continue
        if a == "--state-dir":
            skip = True
            continue
        if a.startswith("--state-dir="):
            continue
        cleaned.append(a)
    return [sys.executable, "-m", "engine", "serve", *cleaned, "--state-dir", state_dir]


def _serve_port(serve_args: list[str]) -> int:
    for i, a in enumerate(serve_args):
        try:
            if a == "--port" and i + 1 < len(serve_args):
                return int(serve_args[i + 1])
            if a.startswith("--port="):
                return int(a.split("=", 1)[1])
        except ValueError:
            break
    return 8000


def supervisord_conf(state_dir: str, command: list[str]) -> str:
    s = _conf_value(state_dir)
    return f"""; written by `python -m engine supervise start`; edit the serve flags there, not here
[unix_http_server]
file={s}/supervisor.sock
chmod=0700

[supervisord]
logfile={s}/logs/supervisord.log
pidfile={s}/supervisord.pid
childlogdir={s}/logs
identifier=v100plan-engine
nodaemon=false
; the program's logs and files: the user's only
umask=077

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{s}/supervisor.sock

[program:{PROGRAM}]
command={_conf_value(shlex.join(command))}
directory={_conf_value(BUNDLE_ROOT)}
environment=PYTHONUNBUFFERED="1"
autostart=true
; restart the proxy whenever it exits, however it exits (SIGKILL included), except serve's exits 2 (bad
; flags or model) and 4 (this host cannot serve: an extra or CUDA missing), which no restart mends.
; supervisord spawns it again at its next 1 s tick (measured: 1.0 s from exit to spawn); startsecs is
; only how long a start must last to count as one (a shorter one is retried with supervisord's backoff).
autorestart=unexpected
exitcodes={",".join(str(c) for c in FINAL_EXITS)}
startsecs=2
startretries=10
stopsignal=TERM
stopwaitsecs=20
; SIGTERM to the proxy alone: it drains and stops its watchdog before its ranks. Only the
; SIGKILL after stopwaitsecs goes to the whole group (the ranks share the proxy's group).
stopasgroup=false
killasgroup=true
stdout_logfile={s}/logs/serve.stdout.log
stderr_logfile={s}/logs/serve.stderr.log
"""


def systemd_unit(command: list[str]) -> str:
    return f"""[Unit]
Description=v100plan engine service (OpenAI-compatible proxy over two rank processes)
After=network.target

[Service]
Type=simple
WorkingDirectory={BUNDLE_ROOT}
Environment=PYTHONUNBUFFERED=1
ExecStart={shlex.join(command)}
Restart=always
RestartPreventExitStatus={" ".join(str(c) for c in FINAL_EXITS)}
# Back within the 5 s a killed proxy is allowed (the proxy's imports and its ranks' start follow).
RestartSec=0.5
# SIGTERM to the proxy alone (it drains, stops its watchdog, then its ranks); the final SIGKILL
# reaches the whole cgroup, so no rank outlives the proxy (they also die with it by PR_SET_PDEATHSIG).
KillMode=mixed
TimeoutStopSec=30

[Install]
WantedBy=default.target
"""


def _ctl(state_dir: str, *args: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c",
                           os.path.join(state_dir, "supervisord.conf"), *args],
                          capture_output=True, text=True, timeout=timeout_s)


def _last_exit(state_dir: str) -> int | None:
    """The program's last exit status from supervisord's own log in the state dir ("exited: engine (exit status
    4; not expected)"), or None when it has not exited (or died of a signal). Its XML-RPC getProcessInfo reports
    exitstatus 0 for a start that exited too quickly, whatever the code was, so the log is what says it."""
    import re

    try:
        with open(os.path.join(state_dir, "logs", "supervisord.log"), errors="replace") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - 16384))
            tail = fh.read()
    except OSError:
        return None
    tail = tail[tail.rfind("supervisord started with pid"):]  # this supervisord's lines, not an earlier run's
    found = re.findall(rf"exited: {PROGRAM} \(exit status (\d+);", tail)
    return int(found[-1]) if found else None


def _pid_alive(pid: int | None, ticks: int | None = None) -> bool:
    """``pid`` runs (not a zombie) and, when its recorded start time ``ticks`` is given, is still that
    process (a PID reused by another process since has a later start time)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(") ", 1)[-1].split()
        return fields[0] != "Z" and (ticks is None or int(fields[19]) == ticks)  # a zombie has exited
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def _read_json(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _supervisord_pid(state_dir: str) -> int | None:
    """supervisord's PID from its pidfile, if that process still runs and is the one `start` recorded."""
    try:
        pid = int(Path(state_dir, "supervisord.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    rec = _read_json(os.path.join(state_dir, "supervisord.json"))
    if rec and rec.get("pid") != pid:
        return None  # the pidfile names another process than the supervisord `start` recorded
    return pid if _pid_alive(pid, rec.get("start_ticks")) else None


def _record_supervisord(state_dir: str) -> None:
    """supervisord.json: its PID and start time, once its pidfile is there (it daemonizes)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            pid = int(Path(state_dir, "supervisord.pid").read_text().strip())
        except (OSError, ValueError):
            time.sleep(0.05)
            continue
        Path(state_dir, "supervisord.json").write_text(json.dumps({"pid": pid, "start_ticks": start_time(pid)}))
        return


def _program_status(state_dir: str) -> dict:
    out = _ctl(state_dir, "status", PROGRAM)
    words = out.stdout.split()
    state = words[1] if len(words) > 1 else None
    pid = None
    if "pid" in words:
        try:
            pid = int(words[words.index("pid") + 1].rstrip(","))
        except (IndexError, ValueError):
            pid = None
    if pid is None and state in ("STARTING", "RUNNING"):
        # a STARTING program's status line has no pid yet (until startsecs pass): ask for it
        try:
            pid = int(_ctl(state_dir, "pid", PROGRAM).stdout.strip()) or None
        except ValueError:
            pid = None
    return {"program_state": state, "proxy_pid": pid, "line": out.stdout.strip()}


def _health(service: dict) -> tuple[int | None, dict | None]:
    host, port = service.get("host"), service.get("port")
    if not host or not port:
        return None, None
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except (ValueError, OSError):
            return exc.code, None
    except (OSError, ValueError):
        return None, None


def start(state_dir: str, serve_args: list[str], wait_healthy_s: float) -> dict:
    if _supervisord_pid(state_dir):
        raise SuperviseError(f"supervisord already runs for {state_dir} (pid {_supervisord_pid(state_dir)}); "
                             "`supervise stop` first")
    command = serve_command(serve_args, state_dir)
    try:
        make_state_dir(state_dir)
        token = service_id(state_dir)  # every process of this service carries it: what `stop` checks
    except StateDirError as exc:
        raise SuperviseError(str(exc)) from None
    os.makedirs(os.path.join(state_dir, "logs"), mode=0o700, exist_ok=True)
    conf = os.path.join(state_dir, "supervisord.conf")
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(supervisord_conf(state_dir, command))
    for name in ("service.json", "supervisord.json", "supervisord.pid"):  # a previous run's PIDs would mislead
        try:
            os.remove(os.path.join(state_dir, name))
        except FileNotFoundError:
            pass
    proc = subprocess.run([sys.executable, "-m", "supervisor.supervisord", "-c", conf],
                          capture_output=True, text=True, timeout=60, cwd=BUNDLE_ROOT,
                          env={**os.environ, ID_ENV: token})
    if proc.returncode != 0:
        raise SuperviseError(f"supervisord did not start: {proc.stderr.strip() or proc.stdout.strip()}")
    _record_supervisord(state_dir)
    result = {"supervisor": "supervisord", "state_dir": state_dir, "config": conf, "command": command}
    deadline = time.monotonic() + wait_healthy_s
    code = None
    while wait_healthy_s > 0 and time.monotonic() < deadline:
        code, _ = _health(_read_json(os.path.join(state_dir, "service.json")))
        if code == 200:
            break
        state = _program_status(state_dir)["program_state"]
        # not restarted: say why now. A serve that exits 2 or 4 within startsecs is, to supervisord, a start that
        # failed (BACKOFF), retried with growing pauses until startretries run out (~70 s); no retry mends those
        # exits, so a BACKOFF after one of them is final too
        if state in ("EXITED", "FATAL") or (state == "BACKOFF" and _last_exit(state_dir) in FINAL_EXITS):
            stop(state_dir)
            raise SuperviseError("the service exited and is not restarted (" + _stderr_tail(state_dir) + "); "
                                 f"see {state_dir}/logs/serve.stderr.log")
        time.sleep(0.3)
    result.update(status(state_dir))
    if wait_healthy_s > 0 and code != 200:
        raise SuperviseError(f"the service did not become healthy within {wait_healthy_s:g} s; "
                             f"see {state_dir}/logs/serve.stderr.log")
    return result


def _stderr_tail(state_dir: str, lines: int = 3) -> str:
    try:
        with open(os.path.join(state_dir, "logs", "serve.stderr.log"), errors="replace") as fh:
            tail = [ln.strip() for ln in fh.read()[-4000:].splitlines() if ln.strip()][-lines:]
    except OSError:
        return "no log"
    return " / ".join(tail) or "it wrote nothing"


def status(state_dir: str) -> dict:
    sup = _supervisord_pid(state_dir)
    service = _read_json(os.path.join(state_dir, "service.json"))
    out = {"supervisord_pid": sup, "running": sup is not None}
    if sup is not None:
        out.update(_program_status(state_dir))
    code, body = _health(service) if sup is not None else (None, None)
    out.update({"rank_pids": service.get("rank_pids", []), "generation": service.get("generation"),
                "health_status": code, "health": body})
    return out


def _ours(state_dir: str, service: dict, token: str | None) -> dict[int, int | None]:
    """PID -> start time of the processes service.json and supervisord's pid file name, where each
    is provably the one we started: it carries the state directory's secret in its environment
    (readable by its owner and root only) and, for those service.json names, still has the recorded
    start time (a PID reused since is not)."""
    started = {}
    for pid, t in (service.get("start_times") or {}).items():
        try:
            if is_same_process(int(pid), t, token):
                started[int(pid)] = t
        except (TypeError, ValueError):
            continue
    sup = _supervisord_pid(state_dir)
    if carries_id(sup, token):
        started[sup] = start_time(sup)
    return started


def stop(state_dir: str, timeout_s: float = 30.0) -> dict:
    """Stop supervisord and every process recorded for this state dir, each only while it is provably the
    process recorded (it carries the state dir's secret, and its start time is the recorded one): a PID
    that is not (another user's, or one reused since) is left alone (``not_ours``). ``stopped`` names only
    what was running."""
    token = service_id(state_dir, create=False)
    sup = _supervisord_pid(state_dir)
    service = _read_json(os.path.join(state_dir, "service.json"))
    program = _program_status(state_dir) if sup else {}
    watched = {"supervisord": sup, "proxy": program.get("proxy_pid") or service.get("proxy_pid")}
    for i, pid in enumerate(service.get("rank_pids") or []):
        watched[f"rank{i}"] = pid
    ours = _ours(state_dir, service, token)  # before the shutdown: only these may be SIGKILLed afterwards
    if carries_id(program.get("proxy_pid"), token):  # the proxy supervisord names now
        ours.setdefault(program["proxy_pid"], start_time(program["proxy_pid"]))
    running = {k: p for k, p in watched.items() if _pid_alive(p) and p in ours}  # what `stopped` may name
    not_ours = [k for k, p in watched.items() if _pid_alive(p) and p not in ours]
    if sup in ours:  # a supervisord that is not provably ours is not asked anything
        _ctl(state_dir, "shutdown", timeout_s=timeout_s)
    # Without a supervisord nothing is stopping them: no point waiting before the SIGKILL.
    deadline = time.monotonic() + (timeout_s if sup in ours else 0.0)
    while time.monotonic() < deadline and any(_pid_alive(p) for p in running.values()):
        time.sleep(0.1)
    killed = []
    for name, pid in running.items():
        if _pid_alive(pid) and is_same_process(pid, ours[pid], token):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(name)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5.0  # a SIGKILLed process takes a moment to be gone
    while killed and time.monotonic() < deadline and any(_pid_alive(running[k]) for k in killed):
        time.sleep(0.05)
    return {"stopped": running, "had_to_kill": killed,
            "left_running": [k for k, p in running.items() if _pid_alive(p) and is_same_process(p, ours[p], token)],
            # a PID service.json names that runs but is not provably the process we started: left alone
            "not_ours": not_ours}


def unit(state_dir: str, serve_args: list[str], install: bool) -> dict:
    command = serve_command(serve_args, state_dir)
    text = systemd_unit(command)
    result: dict = {"unit": text}
    if install:
        if shutil.which("systemctl") is None or not os.path.isdir("/run/systemd/system"):
            raise SuperviseError("this host does not run systemd; use `supervise start` (supervisord) instead")
        target = Path(os.path.expanduser("~/.config/systemd/user/v100plan-engine.service"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        for args in (["daemon-reload"], ["enable", "--now", "v100plan-engine.service"]):
            proc = subprocess.run(["systemctl", "--user", *args], capture_output=True, text=True)
            if proc.returncode != 0:
                raise SuperviseError(f"systemctl --user {' '.join(args)}: {proc.stderr.strip()}")
        result["installed"] = str(target)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, serve_args = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="python -m engine supervise", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("start", "stop", "status", "unit"))
    parser.add_argument("--state-dir", default=None,
                        help="default: per port, as serve's (the --port after `--`, else 8000)")
    parser.add_argument("--wait-healthy-s", type=float, default=0.0,
                        help="start: wait until /health says 200 (0: return once supervisord runs)")
    parser.add_argument("--install", action="store_true", help="unit: install for `systemctl --user` and start it")
    args = parser.parse_args(argv)
    # Never resolved: a symbolic link on the way is refused (state_dir.check_state_dir), not followed.
    state_dir = os.path.abspath(os.path.expanduser(args.state_dir or default_state_dir(_serve_port(serve_args))))
    try:
        if args.action != "unit":
            try:
                check_state_dir(state_dir)
            except StateDirError as exc:
                raise SuperviseError(str(exc)) from None
        if args.action == "start":
            result = start(state_dir, serve_args, args.wait_healthy_s)
        elif args.action == "stop":
            result = stop(state_dir)
        elif args.action == "status":
            result = status(state_dir)
        else:
            result = unit(state_dir, serve_args, args.install)
    except SuperviseError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1 if args.action == "start" else 2
    print(json.dumps(result, indent=1))
    if args.action == "stop" and result["left_running"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
