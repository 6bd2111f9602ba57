"""Connecting safely, against a real sshd on 127.0.0.1: host-key policy, unreachable hosts,
hung commands, quoting. Each failure is a clear `Error:` with its documented exit code."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests import sshd as sshd_mod

pytestmark = pytest.mark.skipif(sshd_mod.available() is not None, reason=str(sshd_mod.available()))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = sshd_mod.make_sshd(tmp_path_factory.mktemp("sshd-connect")).start()
    yield s
    s.stop()


@pytest.fixture
def env(monkeypatch, server, tmp_path_factory):
    root = sshd_mod.shared_remote_root(tmp_path_factory)
    sshd_mod.remote_env(monkeypatch, server, root)
    return root


def _probe(cli, *args):
    return cli("probe", "--quick", "--json", *args)


def test_bad_host_spec_is_bad_input(cli, env):
    r = _probe(cli, "--host", "root@bad host!")
    assert r.exit_code == 2
    assert "Error: host 'root@bad host!' is not user@host[:port]" in sshd_mod.flat(r.stderr)
    assert "Traceback" not in sshd_mod.flat(r.stderr)


def test_inventory_names_the_bad_line(cli, env, tmp_path):
    inv = tmp_path / "hosts.txt"
    inv.write_text("# fleet\nroot@127.0.0.1:2222\n\nroot@127.0.0.1:99999\n")
    r = _probe(cli, "--inventory", inv)
    assert r.exit_code == 2
    assert "line 4" in sshd_mod.flat(r.stderr) and "out of range" in sshd_mod.flat(r.stderr)


def test_unknown_host_key_is_refused_then_recorded_explicitly(cli, env, server, tmp_path, monkeypatch):
    known = tmp_path / "ssh" / "known_hosts"  # not there yet: made 0600 when the first key is recorded
    monkeypatch.setenv("V100PLAN_KNOWN_HOSTS", str(known))
    r = _probe(cli, "--host", server.host_spec)
    assert r.exit_code == 4, r.stderr
    assert "host key for [127.0.0.1]:%d is unknown" % server.port in sshd_mod.flat(r.stderr)
    assert "--accept-new-host-key" in sshd_mod.flat(r.stderr)
    assert not known.exists()  # nothing recorded without the flag

    r = _probe(cli, "--host", server.host_spec, "--accept-new-host-key")
    assert r.exit_code == 3, r.stderr  # connected and probed: no GPU here, every case waived
    import subprocess

    fp = subprocess.run([sshd_mod.SSH_KEYGEN, "-lf", str(server.host_key.with_suffix(".pub"))], capture_output=True,
                        text=True, check=True).stdout.split()[1]  # SHA256:...
    assert f"recorded the host key of [127.0.0.1]:{server.port}" in sshd_mod.flat(r.stderr)
    assert fp in sshd_mod.flat(r.stderr)  # the fingerprint recorded is printed, to check with the owner
    line = known.read_text()
    assert line == server.known_hosts_line()  # the [host]:port form, the server's real key
    assert stat.S_IMODE(os.stat(known).st_mode) == 0o600

    r = _probe(cli, "--host", server.host_spec)  # now known: no flag needed
    assert r.exit_code == 3, r.stderr


def test_changed_host_key_is_refused_even_with_accept_new(cli, env, tmp_path, tmp_path_factory, monkeypatch):
    s = sshd_mod.make_sshd(tmp_path / "impostor").start()
    try:
        known = s.write_known_hosts(tmp_path / "known_hosts")  # the key as first recorded
        monkeypatch.setenv("V100PLAN_KNOWN_HOSTS", str(known))
        monkeypatch.setenv("V100PLAN_SSH_IDENTITY", str(s.user_key))
        before = known.read_text()
        s.regenerate_host_key()
        for extra in ([], ["--accept-new-host-key"]):
            r = _probe(cli, "--host", s.host_spec, *extra)
            assert r.exit_code == 4, r.stderr
            assert "CHANGED" in sshd_mod.flat(r.stderr) and "refusing to connect" in sshd_mod.flat(r.stderr)
            assert "ssh-keygen -R" in sshd_mod.flat(r.stderr)
        assert known.read_text() == before
    finally:
        s.stop()


def test_a_changed_key_behind_an_alias_names_what_ssh_keygen_needs(cli, env, tmp_path, monkeypatch):
    """An ~/.ssh/config alias with a HostName and Port: known_hosts records the key as `[127.0.0.1]:PORT`, and
    the hint names that (`ssh-keygen -R box` would find nothing)."""
    s = sshd_mod.make_sshd(tmp_path / "aliased").start()
    try:
        known = s.write_known_hosts(tmp_path / "known_hosts")
        home = tmp_path / "home"
        (home / ".ssh").mkdir(parents=True, mode=0o700)
        (home / ".ssh" / "config").write_text(f"Host box\n  HostName 127.0.0.1\n  Port {s.port}\n  User {s.user}\n")
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.setenv("V100PLAN_KNOWN_HOSTS", str(known))
        monkeypatch.setenv("V100PLAN_SSH_IDENTITY", str(s.user_key))
        s.regenerate_host_key()
        r = _probe(cli, "--host", "box")
        assert r.exit_code == 4, r.stderr
        err = sshd_mod.flat(r.stderr)
        assert f"ssh-keygen -R '[127.0.0.1]:{s.port}' -f {known}" in err, err
        removed = subprocess.run([sshd_mod.SSH_KEYGEN, "-R", f"[127.0.0.1]:{s.port}", "-f", str(known)],
                                 capture_output=True, text=True, timeout=30)
        assert removed.returncode == 0 and "found" in removed.stdout + removed.stderr  # the hint works as given
    finally:
        s.stop()


def test_unreachable_host_is_exit_4(cli, env):
    port = sshd_mod.free_port()  # nothing listens there
    t0 = time.monotonic()
    r = _probe(cli, "--host", f"root@127.0.0.1:{port}", "--connect-timeout", "3")
    assert r.exit_code == 4
    assert f"root@127.0.0.1:{port}: cannot open an SSH session" in sshd_mod.flat(r.stderr)
    assert "Hint:" in sshd_mod.flat(r.stderr) and "Traceback" not in sshd_mod.flat(r.stderr)
    assert time.monotonic() - t0 < 15


def test_a_missing_identity_file_is_bad_input(cli, env, tmp_path):
    r = _probe(cli, "--host", "root@127.0.0.1:2", "-i", str(tmp_path / "no-such-key"))
    assert r.exit_code == 2, r.stderr
    assert "no such key file here" in sshd_mod.flat(r.stderr) and "Traceback" not in r.stderr


def test_no_key_to_offer_says_so(cli, env, server, tmp_path, monkeypatch):
    """No -i, no agent, no ~/.ssh keys: the message is about keys, not "check that sshd runs there"."""
    monkeypatch.delenv("V100PLAN_SSH_IDENTITY")
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    r = _probe(cli, "--host", server.host_spec)
    assert r.exit_code == 4, r.stderr
    err = sshd_mod.flat(r.stderr)
    assert "no SSH key to offer" in err and "-i/--identity" in err and "sshd runs there" not in err, err


def test_a_port_that_does_not_speak_ssh_says_so(cli, env):
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        t0 = time.monotonic()
        r = _probe(cli, "--host", f"root@127.0.0.1:{silent.getsockname()[1]}", "--connect-timeout", "2")
    assert r.exit_code == 4, r.stderr
    err = sshd_mod.flat(r.stderr)
    assert "does not speak SSH" in err and "No existing session" not in err.split("(")[0], err
    assert time.monotonic() - t0 < 30


def test_the_lock_names_a_user_without_USER(monkeypatch):
    import pwd

    from v100plan.remote import release as rel

    monkeypatch.delenv("USER", raising=False)
    monkeypatch.setattr(rel.os, "getlogin", lambda: (_ for _ in ()).throw(OSError("no controlling terminal")))
    assert rel.local_user() == pwd.getpwuid(os.getuid()).pw_name != "?"


def test_hung_remote_command_is_stopped_and_exit_4(cli, env, server, tmp_path, monkeypatch):
    """A remote interpreter that hangs: the command timeout stops it on the host, by the host's `timeout`."""
    pidfile = tmp_path / "hung.pid"
    fake = tmp_path / "hanging-python"
    fake.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 300\n")
    fake.chmod(0o755)
    monkeypatch.setenv("V100PLAN_REMOTE_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("V100PLAN_REMOTE_PYTHON", str(fake))
    t0 = time.monotonic()
    r = _probe(cli, "--host", server.host_spec, "--command-timeout", "2")
    assert r.exit_code == 4, r.stderr
    assert "did not finish within 2 s" in sshd_mod.flat(r.stderr)
    assert time.monotonic() - t0 < 30
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), "the hung remote process was left running"


@pytest.mark.parametrize("command,sig", [(("probe", "--quick"), "SIGINT"), (("deploy", "--demo-model"), "SIGTERM")])
def test_an_interrupt_stops_the_remote_command_too(server, tmp_path, command, sig):
    """Ctrl-C (or SIGTERM, for deploy) while a remote command runs (here an interpreter that hangs, as a
    long venv build does): the command stops on the host at once, not when it ends by itself, and the
    CLI exits 130."""
    import signal
    import subprocess
    import sys

    from tests.accept_support import REPO

    pidfile = tmp_path / "hung.pid"
    fake = tmp_path / "hanging-python"
    fake.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 300\n")
    fake.chmod(0o755)
    env = {**os.environ, "V100PLAN_KNOWN_HOSTS": str(server.known_hosts), "V100PLAN_SSH_IDENTITY": str(server.user_key),
           "V100PLAN_REMOTE_ROOT": str(tmp_path / "root"), "V100PLAN_REMOTE_PYTHON": str(fake),
           "V100PLAN_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([sys.executable, "-m", "v100plan", command[0], server.host_spec, *command[1:]]
                            if command[0] == "deploy" else
                            [sys.executable, "-m", "v100plan", *command, "--host", server.host_spec],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not pidfile.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert pidfile.exists(), proc.stderr.read() if proc.poll() is not None else "the remote command never started"
    pid = int(pidfile.read_text())
    t0 = time.monotonic()
    os.killpg(proc.pid, getattr(signal, sig))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert time.monotonic() - t0 < 15
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), "the remote command was left running after the interrupt"


def test_remote_arguments_are_quoted(cli, env, server, tmp_path, monkeypatch):
    """A remote root with spaces and shell syntax is one path on the host, never a command."""
    root = tmp_path / "odd root $(touch pwned) ; touch pwned2"
    monkeypatch.setenv("V100PLAN_REMOTE_ROOT", str(root))
    monkeypatch.chdir(tmp_path)
    r = _probe(cli, "--host", server.host_spec)
    assert r.exit_code == 3, r.stderr
    assert json.loads(r.stdout)["kind"] == "probe_report"
    assert (root / "bundles").is_dir()
    home = Path.home()
    for name in ("pwned", "pwned2"):
        assert not (tmp_path / name).exists() and not (home / name).exists()


@pytest.mark.parametrize("text, host, user, port", [
    ("gpu-box", "gpu-box", None, None),
    ("ubuntu@10.0.0.7:2222", "10.0.0.7", "ubuntu", 2222),
    ("root@[::1]:2200", "::1", "root", 2200),
    ("[fe80::1]", "fe80::1", None, None),
])
def test_host_specs(text, host, user, port):
    from v100plan.remote.hosts import parse_host

    spec = parse_host(text)
    assert (spec.host, spec.user, spec.port) == (host, user, port)
    assert spec.label == text


@pytest.mark.parametrize("text", ["", "-oProxyCommand=x", "a b", "u@h:0", "u@h:70000", "u@@h", "h;rm"])
def test_bad_host_specs(text):
    from v100plan.errors import BadInput
    from v100plan.remote.hosts import parse_host

    with pytest.raises(BadInput):
        parse_host(text)


def test_sftp_upload_resumes_a_broken_transfer(server, tmp_path):
    """A .part left by a broken upload is continued from its size, not sent again."""
    import hashlib

    from v100plan.remote.connect import Remote, SshOptions
    from v100plan.remote.hosts import parse_host

    src = tmp_path / "weights.bin"
    src.write_bytes(os.urandom(3_000_000))
    dest = tmp_path / "remote" / "weights.bin"
    dest.parent.mkdir()
    Path(str(dest) + ".part").write_bytes(src.read_bytes()[:1_000_000])  # what the broken upload left
    with Remote(parse_host(server.host_spec), SshOptions(known_hosts=str(server.known_hosts),
                                                         identity=str(server.user_key))) as r:
        sent = r.upload(src, str(dest))
    assert sent == 2_000_000
    assert hashlib.sha256(dest.read_bytes()).digest() == hashlib.sha256(src.read_bytes()).digest()
    assert not Path(str(dest) + ".part").exists()


def test_rsync_uses_the_same_host_key_trust(server, tmp_path):
    """rsync goes through OpenSSH with strict checking against v100plan's known_hosts: a file that
    does not list the host makes it fail rather than trust the key."""
    from v100plan.remote.connect import Remote, SshOptions
    from v100plan.remote.errors import RemoteFailed
    from v100plan.remote.hosts import parse_host

    src = tmp_path / "m"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 100_000)
    dest = tmp_path / "dest dir"
    dest.mkdir()
    opts = SshOptions(known_hosts=str(server.known_hosts), identity=str(server.user_key))
    with Remote(parse_host(server.host_spec), opts) as r:
        assert r.rsync(src, str(dest), ["a.bin"]) > 0
    assert (dest / "a.bin").read_bytes() == b"x" * 100_000
    with Remote(parse_host(server.host_spec), opts) as r:
        other = tmp_path / "other_known_hosts"
        other.write_text("")
        r.known_hosts_path = str(other)  # a known_hosts without this host
        with pytest.raises(RemoteFailed, match="rsync exited"):
            r.rsync(src, str(dest), ["a.bin"])


@pytest.mark.skipif(not __import__("shutil").which("rsync"), reason="rsync is not installed (.ci/run installs it)")
def test_rsync_honours_an_alias_only_ssh_config(server, tmp_path, monkeypatch):
    """A `Host box` alias whose HostName, Port, User, IdentityFile and UserKnownHostsFile live only in
    ~/.ssh/config: Fabric resolves them, and rsync's ssh must reach the host with the same key and the
    same trust (strict checking against that known_hosts), or the upload fails with Permission denied."""
    from v100plan.remote.connect import Remote, SshOptions
    from v100plan.remote.hosts import parse_host

    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    (home / ".ssh" / "config").write_text(
        f"Host box\n  HostName 127.0.0.1\n  Port {server.port}\n  User {server.user}\n"
        f"  IdentityFile {server.user_key}\n  UserKnownHostsFile {server.known_hosts}\n")
    monkeypatch.setenv("HOME", str(home))
    src = tmp_path / "m"
    src.mkdir()
    (src / "a.bin").write_bytes(b"y" * 50_000)
    dest = tmp_path / "dest"
    dest.mkdir()
    with Remote(parse_host("box"), SshOptions()) as r:
        ssh = r.rsync_command()
        assert ssh is not None and str(server.user_key) in ssh and f"UserKnownHostsFile={server.known_hosts}" in ssh
        assert r.rsync(src, str(dest), ["a.bin"]) > 0
    assert (dest / "a.bin").read_bytes() == b"y" * 50_000


def test_commands_on_a_host_with_nothing_deployed(cli, env, server, tmp_path, monkeypatch):
    """status, stop and rollback where nothing was ever deployed: said plainly, nothing created."""
    root = tmp_path / "empty-root"
    monkeypatch.setenv("V100PLAN_REMOTE_ROOT", str(root))
    doc = cli.json("status", server.host_spec)
    assert doc["state"] == "not deployed" and doc["release"] is None
    r = cli("stop", server.host_spec, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["reason"] == "nothing deployed"
    r = cli("rollback", server.host_spec)
    assert r.exit_code == 1
    assert "no previous release of 'engine' to roll back to" in sshd_mod.flat(r.stderr)
    assert not root.exists()


def test_the_port_forward_survives_clients_that_leave_mid_answer(server):
    """Clients that hang up while the host is still sending (a stream cut, a client leaving during prefill)
    close only their own channel: the SSH connection under the forward keeps working. (The forward once
    watched channels with select() on Channel.fileno(), whose notification pipe the transport thread could
    write to after a close: a write on a reused descriptor broke the whole connection.)"""
    import socket
    import threading

    from v100plan.remote.connect import Remote, SshOptions
    from v100plan.remote.hosts import parse_host
    from v100plan.remote.service import _Forward

    body = os.urandom(256 * 1024)
    big = os.urandom(24 * 1024 * 1024)  # more than the socket buffers and the channel's window hold
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    stop = threading.Event()

    def answer(conn):  # reads the request line, then sends the body in small pieces, as a stream does
        try:
            data = big if conn.recv(1024).startswith(b"BIG") else body
            for i in range(0, len(data), 2048):
                conn.sendall(data[i:i + 2048])
        except OSError:
            pass
        finally:
            conn.close()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    with Remote(parse_host(server.host_spec), SshOptions(known_hosts=str(server.known_hosts),
                                                         identity=str(server.user_key))) as r:
        fwd = _Forward(r.open().transport, listener.getsockname()[1])
        try:
            def leave_early(n):
                for _ in range(n):
                    with socket.create_connection(("127.0.0.1", fwd.port), timeout=10) as c:
                        c.sendall(b"GET / HTTP/1.1\r\n\r\n")
                        c.recv(4096)  # part of the answer, then gone while the rest is on its way

            threads = [threading.Thread(target=leave_early, args=(40,)) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert r.open().transport.is_active()
            with socket.create_connection(("127.0.0.1", fwd.port), timeout=10) as c:  # a whole answer still
                c.sendall(b"GET / HTTP/1.1\r\n\r\n")
                got = b""
                while len(got) < len(body):
                    piece = c.recv(65536)
                    if not piece:
                        break
                    got += piece
            assert got == body
            with socket.socket() as c:  # a client slow to read, with a small receive buffer
                c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
                c.settimeout(10)
                c.connect(("127.0.0.1", fwd.port))
                c.sendall(b"BIG / HTTP/1.1\r\n\r\n")
                time.sleep(1.5)  # the forward's writes to it block meanwhile: they must wait, not give up
                parts, n = [], 0
                while n < len(big):
                    piece = c.recv(1 << 20)
                    if not piece:
                        break
                    parts.append(piece)
                    n += len(piece)
            assert b"".join(parts) == big
            assert r.run(["echo", "still-here"]).stdout.strip() == "still-here"  # the same SSH connection
        finally:
            fwd.close()
            stop.set()
            listener.close()
