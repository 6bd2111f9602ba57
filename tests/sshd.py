"""A real OpenSSH server for the remote tests: /usr/sbin/sshd on 127.0.0.1, a free port,
its own config, host key, user key and known_hosts, all in a temporary directory.

Nothing of the system sshd is used: the config names every file. As root the server
allows key-only root login (PermitRootLogin prohibit-password); StrictModes is off
because the keys live in a pytest temporary directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Another sshd/ssh-keygen (a carried copy run through its own loader on a machine without OpenSSH:
# tests/fixtures/remote/record-device-fleet.py) can be named by these variables; CI uses the system's.
SSHD = os.environ.get("V100PLAN_TEST_SSHD") or "/usr/sbin/sshd"
SSH_KEYGEN = os.environ.get("V100PLAN_TEST_SSH_KEYGEN") or shutil.which("ssh-keygen") or "/usr/bin/ssh-keygen"


def available() -> str | None:
    """None when a test sshd can run here, else why not."""
    if not os.path.exists(SSHD):
        return f"{SSHD} is missing (apt-get install openssh-server)"
    if not os.path.exists(SSH_KEYGEN):
        return "ssh-keygen is missing (apt-get install openssh-client)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path, kind: str = "ed25519") -> Path:
    subprocess.run([SSH_KEYGEN, "-q", "-t", kind, "-N", "", "-C", "v100plan-test", "-f", str(path)],
                   check=True, capture_output=True, timeout=30)
    return path


@dataclass
class Sshd:
    """One running sshd: ``host_spec`` is what `--host` takes; ``known_hosts`` lists its key."""

    dir: Path
    port: int
    user: str
    user_key: Path
    known_hosts: Path
    host_key: Path
    proc: subprocess.Popen | None = None
    extra_config: str = ""  # more sshd_config lines (docs/remote_probe_cost.py: SetEnv SHLVL=1)

    @property
    def host_spec(self) -> str:
        return f"{self.user}@127.0.0.1:{self.port}"

    def known_hosts_line(self) -> str:
        pub = (self.host_key.with_suffix(".pub")).read_text().split()
        return f"[127.0.0.1]:{self.port} {pub[0]} {pub[1]}\n"

    def write_known_hosts(self, path: Path | None = None) -> Path:
        p = path or self.known_hosts
        p.write_text(self.known_hosts_line())
        return p

    def start(self) -> Sshd:
        cfg = self.write_config()
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.dir / "sshd.log", "ab"))
        return self._wait_ready()

    def write_config(self) -> Path:
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # the privilege-separation directory
        cfg = self.dir / "sshd_config"
        cfg.write_text(f"""ListenAddress 127.0.0.1
Port {self.port}
HostKey {self.host_key}
PidFile {self.dir / 'sshd.pid'}
AuthorizedKeysFile {self.dir / 'authorized_keys'}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
MaxStartups 100:30:200
MaxSessions 64
LogLevel ERROR
Subsystem sftp internal-sftp
""" + self.extra_config)
        return cfg

    def _wait_ready(self, connect=None) -> Sshd:  # noqa: ANN001 - (host, port) -> socket
        """Until the server sends its SSH banner (``connect`` reaches it where 127.0.0.1 does not)."""
        connect = connect or (lambda: socket.create_connection(("127.0.0.1", self.port), timeout=0.5))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {self.proc.returncode}: "
                                   f"{(self.dir / 'sshd.log').read_text()[-2000:]}")
            try:
                with connect() as s:
                    if s.recv(4).startswith(b"SSH-"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("sshd did not answer within 15 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # our own child, by its PID
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def regenerate_host_key(self) -> None:
        """Give the server a new host key (restarts it): what a reinstalled or impostor host looks like."""
        self.stop()
        for p in (self.host_key, self.host_key.with_suffix(".pub")):
            p.unlink()
        keygen(self.host_key)
        self.start()


def make_sshd(base: Path, user_key: Path | None = None, port: int | None = None) -> Sshd:
    """A configured (not yet started) sshd in ``base``; ``user_key`` shared across fake hosts if given."""
    base.mkdir(parents=True, exist_ok=True)
    host_key = keygen(base / "host_ed25519")
    if user_key is None:
        user_key = keygen(base / "user_ed25519")
    (base / "authorized_keys").write_text(user_key.with_suffix(".pub").read_text())
    user = os.environ.get("USER") or __import__("pwd").getpwuid(os.geteuid()).pw_name
    s = Sshd(dir=base, port=port or free_port(), user=user, user_key=user_key,
             known_hosts=base / "known_hosts", host_key=host_key)
    s.write_known_hosts()
    return s


def remote_python() -> str:
    """The interpreter the fake hosts use for venvs: this test run's base Python (not its venv)."""
    base = Path(sys.base_prefix) / "bin"
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"):
        if (base / name).exists():
            return str(base / name)
    return "python3"


def shared_remote_root(tmp_path_factory) -> Path:  # noqa: ANN001 - pytest's TempPathFactory
    """One remote root for the whole test session: venvs are content-addressed and built under a lock,
    so every test module reuses the one venv per dependency set (what a real host does)."""
    keep = os.environ.get("V100PLAN_TEST_REMOTE_ROOT")  # a root kept across runs while iterating locally
    p = Path(keep) if keep else tmp_path_factory.getbasetemp() / "remote-root"
    p.mkdir(parents=True, exist_ok=True)
    return p


def flat(text: str) -> str:
    """Console text with its line wrapping undone, for substring checks."""
    return " ".join(text.split())


def remote_env(monkeypatch, sshd: Sshd, root: Path, known_hosts: Path | None = None) -> None:  # noqa: ANN001
    """Point every remote command of v100plan at this sshd's key, known_hosts and the given root."""
    monkeypatch.setenv("V100PLAN_KNOWN_HOSTS", str(known_hosts or sshd.known_hosts))
    monkeypatch.setenv("V100PLAN_SSH_IDENTITY", str(sshd.user_key))
    monkeypatch.setenv("V100PLAN_REMOTE_ROOT", str(root))
    monkeypatch.setenv("V100PLAN_REMOTE_PYTHON", remote_python())


RELAY = """import os, socket, sys, threading
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def up():
    while True:
        d = os.read(0, 65536)
        if not d:
            s.shutdown(socket.SHUT_WR)
            return
        s.sendall(d)
threading.Thread(target=up, daemon=True).start()
while True:
    d = s.recv(65536)
    if not d:
        break
    os.write(1, d)
"""


def start_apart(s: Sshd, root_at: Path, own_root: Path) -> str:
    """Start ``s`` as a host of its own on this machine (root only): sshd in new network and mount namespaces,
    where 127.0.0.1 is its own (a service on a port does not meet another host's), ``own_root`` is mounted at
    ``root_at`` (that path is its own folder) and /dev/shm is private. It has no network beyond its loopback
    (no package index): what it needs from one must be there already. Returns the ssh ProxyCommand that
    reaches it (a relay run in its network namespace)."""
    cfg = s.write_config()
    script = (f"ip link set lo up && mount --make-rprivate / && mount --bind {own_root} {root_at} && "
              f"mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec {SSHD} -D -e -f {cfg}")
    s.proc = subprocess.Popen(["unshare", "--net", "--mount", "sh", "-c", script], stdout=subprocess.DEVNULL,
                              stderr=open(s.dir / "sshd.log", "ab"))
    relay = s.dir / "relay.py"
    relay.write_text(RELAY)
    proxy = f"nsenter --net=/proc/{s.proc.pid}/ns/net {sys.executable} {relay} {s.port}"

    def connect():  # the banner through the relay, as a socket-like object for _wait_ready
        r = subprocess.run(proxy.split(), input=b"", capture_output=True, timeout=10)
        if not r.stdout:
            raise OSError("no banner yet")
        return _Banner(r.stdout)

    s._wait_ready(connect)
    return proxy


class _Banner:
    def __init__(self, data: bytes):
        self.data = data

    def recv(self, n: int) -> bytes:
        return self.data[:n]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass
