"""Where a remote probe's time goes: one warm host and a fleet, against loopback sshd instances.

    python docs/remote_probe_cost.py [--hosts 32] [--rounds 3] [--no-shell-init]

Starts --hosts sshd instances (tests/sshd.py) sharing one remote root under a temporary directory,
makes the probe bundle and venv there once, then times the library calls `probe_host` and
`probe_fleet` (warm: one SSH connection and one exec per host) and a few reference commands.
Counts SSH connections and channels (paramiko's Transport.start_client / open_channel), client CPU
(getrusage of this process, every thread) and host CPU (each sshd listener's /proc stat: its own
time plus that of its reaped sessions, i.e. sshd, the login shell and everything under it).
--no-shell-init gives the sessions SHLVL=1 (sshd_config SetEnv), so bash skips ~/.bashrc as it
does for a shell that is not top-level: a host whose shell init is empty. docs/deploy.md has the
figures and what they mean.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import paramiko  # noqa: E402

from tests import sshd as sshd_mod  # noqa: E402
from v100plan.remote.connect import Remote, SshOptions  # noqa: E402
from v100plan.remote.host import RemoteSettings  # noqa: E402
from v100plan.remote.hosts import parse_host  # noqa: E402
from v100plan.remote.probe import probe_fleet, probe_host  # noqa: E402

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


def measure(label: str, fn, servers, hosts: int = 1) -> float:  # noqa: ANN001
    COUNT.update(connections=0, channels=0)
    h0, c0, t0 = host_cpu(servers), client_cpu(), time.monotonic()
    fn()
    wall = time.monotonic() - t0
    time.sleep(0.3)  # let each sshd reap its sessions, so their CPU is counted
    print(f"{label:<40} {COUNT['connections']:>3} conn {COUNT['channels']:>3} chan  wall {wall:6.2f} s  "
          f"client CPU {(client_cpu() - c0) / hosts:5.3f} s/host  host CPU {(host_cpu(servers) - h0) / hosts:5.3f} s/host",
          flush=True)
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-shell-init", action="store_true")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="v1p-cost-"))
    servers = []
    try:
        for i in range(args.hosts):
            s = sshd_mod.make_sshd(base / f"h{i:02d}", user_key=servers[0].user_key if servers else None)
            s.extra_config = "SetEnv SHLVL=1\n" if args.no_shell_init else ""
            servers.append(s.start())
        known = base / "known_hosts"
        known.write_text("".join(s.known_hosts_line() for s in servers))
        ssh = SshOptions(known_hosts=str(known), identity=str(servers[0].user_key))
        rs = RemoteSettings(root=str(base / "remote-root"), python=sshd_mod.remote_python())
        specs = [parse_host(s.host_spec) for s in servers]
        probe_host(specs[0], ssh, rs, ["--quick"])  # cold: bundle uploaded, venv built; the rest is warm
        time.sleep(1)  # its sessions reaped before the first measurement

        def run(argv):  # noqa: ANN001, ANN202
            def once() -> None:
                with Remote(specs[0], ssh) as r:
                    if argv:
                        r.run(argv)
            return once

        print(f"{args.hosts} loopback sshd, {len(os.sched_getaffinity(0))} cores, "
              f"shell init {'skipped' if args.no_shell_init else 'as the user has it'}")
        one, fleet = [], []
        for _ in range(args.rounds):
            measure("connect + authenticate, no command", run(None), servers)
            measure("connect + `true`", run(["true"]), servers)
            measure("connect + python3 -c pass", run([rs.python, "-c", "pass"]), servers)
            one.append(measure("one host: probe_host --quick", lambda: probe_host(specs[0], ssh, rs, ["--quick"]),
                               servers))
        for _ in range(args.rounds):
            fleet.append(measure(f"{args.hosts} hosts: probe_fleet --quick",
                                 lambda: probe_fleet(specs, ssh, rs, ["--quick"]), servers, args.hosts))
        print(f"one host median {statistics.median(one):.2f} s, fleet median {statistics.median(fleet):.2f} s, "
              f"ratio {statistics.median(fleet) / statistics.median(one):.1f}")
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
