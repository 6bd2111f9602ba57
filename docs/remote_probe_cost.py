"""Where a remote probe's time goes: one warm host and a fleet, against loopback sshd instances.

    python docs/remote_probe_cost.py [--hosts 32] [--rounds 3] [--no-shell-init]
        [--setenv NAME=VALUE ...] [--remote-python PY] [--remote-root DIR] [--probe-args ARGS] [--json FILE]
        [--fleet-references]

Starts --hosts sshd instances (tests/sshd.py) sharing one remote root under a temporary directory,
makes the probe bundle and venv there once, then times the library calls `probe_host` and
`probe_fleet` (warm: one SSH connection and one exec per host) and a few reference commands.
Counts SSH connections and channels (paramiko's Transport.start_client / open_channel), client CPU
(getrusage of this process, every thread) and host CPU (each sshd listener's /proc stat: its own
time plus that of its reaped sessions, i.e. sshd, the login shell and everything under it).
--no-shell-init gives the sessions SHLVL=1 (sshd_config SetEnv), so bash skips ~/.bashrc as it
does for a shell that is not top-level: a host whose shell init is empty. --setenv gives the
sessions more environment (sshd_config SetEnv: a pip config, NCCL settings), --remote-python names
the host's interpreter, --remote-root the hosts' shared root (default: under the temporary directory),
--probe-args what `python -m probes` gets (default --quick; on a host whose
GPUs the sessions can see, "--quick --only inventory" loads no GPU), --json writes every measurement, with each fleet host's start and end, to
FILE (tests/fixtures/remote/record-device-fleet.py records with it). --fleet-references also runs
the reference commands (`true`, `python3 -c pass`, an NVML read in the probe venv) on one host and
on every host at once, to find what a fleet waits on. docs/deploy.md has the figures
and what they mean.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import paramiko  # noqa: E402

from tests import sshd as sshd_mod  # noqa: E402
from v100plan.remote import venv as venv_mod  # noqa: E402
from v100plan.remote.connect import Remote, SshOptions  # noqa: E402
from v100plan.remote.host import RemoteSettings  # noqa: E402
from v100plan.remote.hosts import parse_host  # noqa: E402
from v100plan.remote.probe import HostResult, probe_fleet, probe_host  # noqa: E402

COUNT = {"connections": 0, "channels": 0}
_LOCK = threading.Lock()


def _counting(method, key):  # noqa: ANN001, ANN202
    def wrapper(self, *a, **k):  # noqa: ANN001, ANN202
        with _LOCK:
            COUNT[key] += 1
        return method(self, *a, **k)
    return wrapper


paramiko.Transport.start_client = _counting(paramiko.Transport.start_client, "connections")
paramiko.Transport.open_channel = _counting(paramiko.Transport.open_channel, "channels")


def host_cpu(servers) -> float:  # noqa: ANN001
    total = 0.0
    for s in servers:
        f = Path(f"/proc/{s.proc.pid}/stat").read_text().split(") ")[1].split()
        total += sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    return total


def client_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


RECORD: list[dict] = []  # every measurement, for --json


def measure(label: str, fn, servers, hosts: int = 1) -> float:  # noqa: ANN001
    COUNT.update(connections=0, channels=0)
    h0, c0, t0 = host_cpu(servers), client_cpu(), time.monotonic()
    result = fn()
    wall = time.monotonic() - t0
    client = (client_cpu() - c0) / hosts
    time.sleep(0.3)  # let each sshd reap its sessions, so their CPU is counted
    host = (host_cpu(servers) - h0) / hosts
    print(f"{label:<40} {COUNT['connections']:>3} conn {COUNT['channels']:>3} chan  wall {wall:6.2f} s  "
          f"client CPU {client:5.3f} s/host  host CPU {host:5.3f} s/host", flush=True)
    entry = {"what": label, "hosts": hosts, "connections": COUNT["connections"], "channels": COUNT["channels"],
             "wall_s": round(wall, 4), "client_cpu_s_per_host": round(client, 4),
             "host_cpu_s_per_host": round(host, 4), "t0": t0}
    if isinstance(result, list):  # probe_fleet's HostResults: each host's interval, relative to t0
        entry["per_host"] = [{"host": r.host, "ok": r.report is not None, "error": r.error,
                              "overall": (r.report or {}).get("overall"),
                              "start_s": round(r.started_s - t0, 4), "end_s": round(r.ended_s - t0, 4),
                              "wall_s": round(r.wall_s, 4)} for r in result]
    RECORD.append(entry)
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-shell-init", action="store_true")
    ap.add_argument("--setenv", action="append", default=[], metavar="NAME=VALUE",
                    help="more environment for the sessions (sshd_config SetEnv)")
    ap.add_argument("--remote-python", help="the host's Python (default: this run's base Python)")
    ap.add_argument("--remote-root", help="the hosts' remote root (default: a temporary one)")
    ap.add_argument("--probe-args", default="--quick", help="what python -m probes gets (one string)")
    ap.add_argument("--json", metavar="FILE", help="write every measurement here")
    ap.add_argument("--fleet-references", action="store_true",
                    help="also run the reference commands on one host and on every host at once")
    args = ap.parse_args()
    setenv = (["SHLVL=1"] if args.no_shell_init else []) + args.setenv
    pargs = shlex.split(args.probe_args)
    base = Path(tempfile.mkdtemp(prefix="v1p-cost-"))
    servers = []
    try:
        for i in range(args.hosts):
            s = sshd_mod.make_sshd(base / f"h{i:02d}", user_key=servers[0].user_key if servers else None)
            s.extra_config = f"SetEnv {' '.join(setenv)}\n" if setenv else ""
            servers.append(s.start())
        known = base / "known_hosts"
        known.write_text("".join(s.known_hosts_line() for s in servers))
        ssh = SshOptions(known_hosts=str(known), identity=str(servers[0].user_key))
        rs = RemoteSettings(root=args.remote_root or str(base / "remote-root"), python=args.remote_python or sshd_mod.remote_python())
        specs = [parse_host(s.host_spec) for s in servers]
        t0 = time.monotonic()
        first = probe_host(specs[0], ssh, rs, pargs)  # cold: bundle uploaded, venv built; the rest is warm
        cold_s = time.monotonic() - t0
        print(f"cold probe_host {args.probe_args} {cold_s:.2f} s; its cases: "
              + ", ".join(f"{c['key']} {c['status']}" for c in first["cases"]), flush=True)
        time.sleep(1)  # its sessions reaped before the first measurement

        def run(argv):  # noqa: ANN001, ANN202
            def once() -> None:
                with Remote(specs[0], ssh) as r:
                    if argv:
                        r.run(argv, check=False)
            return once

        print(f"{args.hosts} loopback sshd, {len(os.sched_getaffinity(0))} cores, "
              f"shell init {'skipped' if args.no_shell_init else 'as the user has it'}")
        one, fleet = [], []
        for _ in range(args.rounds):
            measure("connect + authenticate, no command", run(None), servers)
            measure("connect + `true`", run(["true"]), servers)
            measure("connect + python3 -c pass", run([rs.python, "-c", "pass"]), servers)
            one.append(measure(f"one host: probe_host {args.probe_args}",
                               lambda: probe_host(specs[0], ssh, rs, pargs), servers))
        for _ in range(args.rounds):
            fleet.append(measure(f"{args.hosts} hosts: probe_fleet {args.probe_args}",
                                 lambda: probe_fleet(specs, ssh, rs, pargs), servers, args.hosts))
        print(f"one host median {statistics.median(one):.2f} s, fleet median {statistics.median(fleet):.2f} s, "
              f"ratio {statistics.median(fleet) / statistics.median(one):.1f}")
        if args.fleet_references:
            vid = venv_mod.venv_id(rs.python, venv_mod.probe_requirements(), rs.index_url)
            nvml = [f"{rs.root}/venvs/{vid}/bin/python", "-c", "import pynvml as n; n.nvmlInit(); "
                    "[n.nvmlDeviceGetName(n.nvmlDeviceGetHandleByIndex(i)) for i in range(n.nvmlDeviceGetCount())]"]

            def on_every_host(argv):  # noqa: ANN001, ANN202
                def one_host(spec) -> HostResult:  # noqa: ANN001
                    res = HostResult(host=spec.label, started_s=time.monotonic())
                    try:
                        with Remote(spec, ssh) as r:
                            code = r.run(argv, check=False).exit_code
                        res.report = {"overall": f"exit {code}"}
                    except Exception as e:  # noqa: BLE001 - recorded, never stops the others
                        res.error = f"{type(e).__name__}: {e}"
                    res.ended_s = time.monotonic()
                    res.wall_s = res.ended_s - res.started_s
                    return res

                def all_hosts() -> list[HostResult]:
                    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
                        return list(pool.map(one_host, specs))
                return all_hosts

            for _ in range(min(args.rounds, 3)):
                for label, argv in (("`true`", ["true"]), ("python3 -c pass", [rs.python, "-c", "pass"]),
                                    ("NVML read (probe venv)", nvml)):
                    measure(f"connect + {label}", run(argv), servers)
                    measure(f"{args.hosts} hosts: connect + {label}", on_every_host(argv), servers, args.hosts)
        if args.json:
            doc = {"hosts": args.hosts, "rounds": args.rounds, "setenv": setenv, "probe_args": pargs,
                   "cores": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
                   "cold_probe_s": round(cold_s, 3),
                   "cold_probe_cases": {c["key"]: c["status"] for c in first["cases"]},
                   "one_host_median_s": round(statistics.median(one), 4),
                   "fleet_median_s": round(statistics.median(fleet), 4),
                   "measurements": [{k: v for k, v in e.items() if k != "t0"} for e in RECORD]}
            Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
