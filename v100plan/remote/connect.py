"""Opening SSH connections with Fabric, with the host-key policy v100plan promises.

Fabric alone auto-adds unknown host keys and never loads known_hosts. Here every
connection loads known_hosts (``--known-hosts FILE``, else ssh_config's
UserKnownHostsFile, else ~/.ssh/known_hosts) and refuses a key it does not know
(paramiko RejectPolicy semantics). ``--accept-new-host-key`` records an unknown key
explicitly (``[host]:port`` form for ports other than 22). A key that differs from the
recorded one always fails, with a message that says it changed.

Every command is built from an argument list joined with shlex, wrapped in the host's
``timeout`` so a hung command is stopped there too, and run with a local timeout as a
backstop. Fabric is imported only inside v100plan/remote.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from v100plan.remote.errors import HostKeyError, RemoteFailed, RemoteTimeout, Unreachable
from v100plan.remote.hosts import HostSpec

# exit status of coreutils `timeout` when it had to stop the command
TIMEOUT_EXIT = 124
_PID_MARK = "@v100plan-remote-pid "
_KNOWN_HOSTS_LOCK = threading.Lock()


def interrupt_on_sigterm() -> None:
    """SIGTERM acts as Ctrl-C for the rest of this process (a deploy stopped by a service manager or
    `kill` cleans up as an interrupted one does). Main thread only."""
    signal.signal(signal.SIGTERM, interrupt_on_sigterm.handler)


def _raise_interrupt(_signum, _frame):  # noqa: ANN001 - a signal handler
    raise KeyboardInterrupt


interrupt_on_sigterm.handler = _raise_interrupt


@dataclass(frozen=True)
class SshOptions:
    known_hosts: str | None = None        # None: ssh_config's UserKnownHostsFile, else ~/.ssh/known_hosts
    accept_new_host_key: bool = False
    identity: str | None = None           # a private key file (else ssh_config / agent / ~/.ssh keys)
    connect_timeout_s: float = 10.0
    command_timeout_s: float = 900.0


@dataclass(frozen=True)
class Result:
    command: str
    exit_code: int
    stdout: str
    stderr: str


def _known_hosts_path(options: SshOptions, ssh_config: dict) -> str:
    if options.known_hosts:
        return os.path.expanduser(options.known_hosts)
    files = ssh_config.get("userknownhostsfile")
    if files:
        return os.path.expanduser(str(files).split()[0])
    return os.path.expanduser("~/.ssh/known_hosts")


def _fingerprint(key) -> str:  # noqa: ANN001 - a paramiko PKey
    import base64
    import hashlib

    digest = hashlib.sha256(key.asbytes()).digest()
    return f"{key.get_name()} SHA256:{base64.b64encode(digest).decode().rstrip('=')}"


def _policy(known_hosts: str, accept_new: bool):
    """A paramiko MissingHostKeyPolicy: refuse (default) or record the key in ``known_hosts``."""
    from paramiko.client import MissingHostKeyPolicy

    class Policy(MissingHostKeyPolicy):
        def missing_host_key(self, client, hostname, key):  # noqa: ANN001 - paramiko's signature
            if not accept_new:
                raise HostKeyError(
                    f"host key for {hostname} is unknown ({_fingerprint(key)}); refusing to connect",
                    hint=f"check the fingerprint with the host's owner, then run again with "
                         f"--accept-new-host-key to record it in {known_hosts}")
            line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
            with _KNOWN_HOSTS_LOCK:
                Path(known_hosts).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                fd = os.open(known_hosts, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)
            client.get_host_keys().add(hostname, key.get_name(), key)
            from v100plan import output

            output.hint(f"recorded the host key of {hostname} in {known_hosts}: {_fingerprint(key)} "
                        "(compare it with the one its owner gave you)")

    return Policy()


class Remote:
    """One open SSH connection to one host (a Fabric Connection with v100plan's policy)."""

    def __init__(self, spec: HostSpec, options: SshOptions):
        self.spec = spec
        self.options = options
        self.bytes_sent = 0
        self.known_hosts_path: str | None = None
        self._conn = None
        self._sftp = None

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def ssh_hint(self) -> str:
        """The OpenSSH command that reaches the same host, for hints."""
        who = (f"{self.spec.user}@" if self.spec.user else "") + self.spec.host
        return "ssh " + (f"-p {self.spec.port} " if self.spec.port else "") + shlex.quote(who)

    @property
    def connection(self):
        """The underlying fabric.Connection (open)."""
        return self.open()

    def open(self):
        if self._conn is not None:
            return self._conn
        import paramiko
        from fabric import Config, Connection

        kwargs = {}
        if self.options.identity:
            kwargs["key_filename"] = [os.path.expanduser(self.options.identity)]
        conn = Connection(self.spec.host, user=self.spec.user, port=self.spec.port, config=Config(),
                          connect_timeout=max(1, int(round(self.options.connect_timeout_s))),
                          connect_kwargs=kwargs)
        known = _known_hosts_path(self.options, conn.ssh_config)
        self.known_hosts_path = known
        conn.client.set_missing_host_key_policy(_policy(known, self.options.accept_new_host_key))
        if os.path.exists(known):
            try:
                conn.client.load_host_keys(known)
            except (OSError, paramiko.SSHException) as e:
                raise HostKeyError(f"known_hosts file {known} cannot be read: {e}",
                                   hint="fix or move that file, or name another with --known-hosts") from None
        where = f"{self.label}"
        try:
            conn.open()
        except HostKeyError:
            raise
        except paramiko.BadHostKeyException as e:
            raise HostKeyError(
                f"host key for {where} CHANGED: known_hosts ({known}) has {_fingerprint(e.expected_key)}, "
                f"the host offered {_fingerprint(e.key)}; refusing to connect (this can be an attack)",
                hint=f"if the host was really reinstalled, remove its old line with "
                     f"`ssh-keygen -R {shlex.quote(self._known_name(conn))} -f {shlex.quote(known)}` "
                     f"and run again with --accept-new-host-key") from None
        except paramiko.AuthenticationException as e:
            raise Unreachable(f"{where}: SSH authentication failed ({e})",
                              hint="check the user name and key (-i/--identity, ssh-agent, ~/.ssh/config)") from None
        except (TimeoutError, socket.timeout):
            raise Unreachable(f"{where}: no SSH answer within {self.options.connect_timeout_s:g} s",
                              hint="check the host name, port and firewall; --connect-timeout waits longer") from None
        except socket.gaierror as e:
            raise Unreachable(f"{where}: host name cannot be resolved ({e.strerror})",
                              hint="check the spelling, or add the host to ~/.ssh/config") from None
        except paramiko.SSHException as e:
            text = str(e)
            if "No authentication methods available" in text or "no keys" in text.lower():
                raise Unreachable(f"{where}: no SSH key to offer ({text})",
                                  hint="give one with -i/--identity, an IdentityFile in ~/.ssh/config, or load it "
                                       "into ssh-agent") from None
            if "banner" in text or "No existing session" in text:
                raise Unreachable(f"{where}: something answers on port {self.spec.port or 22} but does not speak SSH "
                                  f"within {self.options.connect_timeout_s:g} s ({text})",
                                  hint="check the port: is it sshd's? (`ssh -v` shows what answers)") from None
            raise Unreachable(f"{where}: cannot open an SSH session ({text or type(e).__name__})",
                              hint=f"check that sshd runs there: {self.ssh_hint}") from None
        except (OSError, EOFError) as e:
            raise Unreachable(f"{where}: cannot open an SSH session ({e or type(e).__name__})",
                              hint=f"check that sshd runs there: {self.ssh_hint}") from None
        self._conn = conn
        return conn

    def _known_name(self, conn) -> str:  # noqa: ANN001 - a fabric Connection
        """The name the host's key is recorded under in known_hosts, as `ssh-keygen -R` needs it: the host and
        port the connection resolved (an ~/.ssh/config alias's HostName and Port: ``[127.0.0.1]:42622``),
        else the name as given."""
        def name(host: str, port: int | None) -> str:
            return host if (port or 22) == 22 else f"[{host}]:{port}"

        names = [name(conn.host, conn.port), name(self.spec.host, self.spec.port)]
        keys = conn.client.get_host_keys()
        return next((n for n in names if keys.lookup(n) is not None), names[0])

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
            self._sftp = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Remote:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- commands --------------------------------------------------------------------------

    def run(self, argv: Sequence[str], *, cwd: str | None = None, timeout_s: float | None = -1,
            check: bool = True, what: str | None = None, env: dict[str, str] | None = None) -> Result:
        """Run ``argv`` (each item shlex-quoted) on the host. ``timeout_s`` -1: the default command
        timeout; None: no timeout (a follow). A non-zero exit raises RemoteFailed when ``check``."""
        import invoke

        conn = self.open()
        command = shlex.join(argv)
        if env:
            command = shlex.join(["env", *(f"{k}={v}" for k, v in env.items())]) + " " + command
        if cwd:
            command = f"cd {shlex.quote(cwd)} && {command}"
        limit = self.options.command_timeout_s if timeout_s == -1 else timeout_s
        if limit is not None:
            # stopped on the host by `timeout` (TERM, then KILL 5 s later), locally 15 s after that. Its PID
            # comes first on stderr, so Ctrl-C here can stop it there (and everything in its process group)
            command = (f"echo {_PID_MARK}$$ >&2; exec timeout -k 5 {max(1, int(limit))} "
                       f"sh -c {shlex.quote(command)}")
        label = what or shlex.join(argv[:3])
        runner = conn.config.runners.remote(context=conn, inline_env=conn.inline_ssh_env)
        try:
            with self._interruptible(runner):
                r = runner.run(command, hide=True, warn=True, in_stream=False,
                               timeout=None if limit is None else limit + 20)
        except invoke.exceptions.CommandTimedOut:
            raise RemoteTimeout(f"{self.label}: `{label}` did not finish within {limit:g} s",
                                hint="the host may be overloaded or the command hung; --command-timeout "
                                     "allows longer") from None
        except (OSError, EOFError) as e:
            raise Unreachable(f"{self.label}: the SSH connection broke during `{label}` ({e})",
                              hint="run again; check the network and the host") from None
        if limit is not None and r.exited == TIMEOUT_EXIT:
            raise RemoteTimeout(f"{self.label}: `{label}` did not finish within {limit:g} s and was stopped there",
                                hint="the host may be overloaded or the command hung; --command-timeout "
                                     "allows longer")
        stderr = r.stderr[r.stderr.index("\n") + 1:] if r.stderr.startswith(_PID_MARK) else r.stderr
        result = Result(label, r.exited, r.stdout, stderr)
        if check and r.exited != 0:
            tail = (stderr.strip() or r.stdout.strip())[-800:]
            raise RemoteFailed(f"{self.label}: `{label}` exited with {r.exited}: {tail}",
                               hint=f"run it by hand to see the whole output: {self.ssh_hint}")
        return result

    @contextlib.contextmanager
    def _interruptible(self, runner) -> Iterator[None]:  # noqa: ANN001 - a fabric.runners.Remote
        """While ``runner`` runs a command: Ctrl-C (or SIGTERM) stops that command on the host too (TERM to
        the `timeout` whose PID it printed first, which passes it to its process group), then raises
        KeyboardInterrupt here. Without this the SSH channel stays open until the command ends by itself.
        Signals that a caller is holding back (``bluegreen.shielded``) stay held back."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def stop_there(_signum, _frame):  # noqa: ANN001 - a signal handler
            text = "".join(runner.stderr)
            if text.startswith(_PID_MARK) and "\n" in text:
                with contextlib.suppress(Exception):  # the connection itself may be the problem
                    self._kill_remote(int(text[len(_PID_MARK):text.index("\n")]))
            raise KeyboardInterrupt

        mine = {}
        for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
            if signal.getsignal(sig) in (default, interrupt_on_sigterm.handler):
                mine[sig] = signal.signal(sig, stop_there)
        try:
            yield
        finally:
            for sig, old in mine.items():
                signal.signal(sig, old)

    def _kill_remote(self, pid: int) -> None:
        """TERM to the host's `timeout` with this PID (only while that PID is a `timeout`), on a channel of its
        own; waits up to 5 s for it."""
        chan = self.open().client.get_transport().open_session(timeout=5)
        chan.settimeout(10)
        chan.exec_command(f'[ "$(cat /proc/{pid}/comm 2>/dev/null)" = timeout ] && kill -TERM {pid}; '
                          f'for i in 1 2 3 4 5 6 7 8 9 10; do kill -0 {pid} 2>/dev/null || exit 0; sleep 0.5; done')
        chan.recv_exit_status()
        chan.close()

    def stream(self, argv: Sequence[str], on_line: Callable[[str], None], *, cwd: str | None = None) -> int:
        """Run ``argv`` with no timeout, passing stdout lines to ``on_line`` as they arrive (logs --follow)."""
        conn = self.open()
        command = shlex.join(argv)
        if cwd:
            command = f"cd {shlex.quote(cwd)} && {command}"
        chan = conn.client.get_transport().open_session()
        chan.get_pty(width=250)  # the host hangs the command up (SIGHUP) when we close the channel
        chan.exec_command(command)
        buf = b""
        try:
            while True:
                data = chan.recv(65536)
                if not data:
                    break
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    on_line(line.decode(errors="replace").rstrip("\r"))
        finally:
            chan.close()
        if buf.strip():
            on_line(buf.decode(errors="replace").rstrip("\r"))
        return chan.recv_exit_status()

    # -- files -----------------------------------------------------------------------------

    def sftp(self):
        if self._sftp is None:
            self._sftp = self.open().sftp()
        return self._sftp

    def read_text(self, path: str) -> str:
        with self.sftp().open(path, "r") as fh:
            return fh.read().decode()

    def upload(self, local: str | Path, remote: str, on_bytes: Callable[[int], None] | None = None) -> int:
        """Send ``local`` to ``remote`` resumably: into ``remote.part`` (continued from its size if a
        previous upload broke off), then renamed. Returns the bytes sent now."""
        sftp = self.sftp()
        part = remote + ".part"
        total = os.path.getsize(local)
        try:
            done = sftp.stat(part).st_size or 0
        except OSError:
            done = 0
        if done > total:
            sftp.remove(part)
            done = 0
        sent = 0
        with open(local, "rb") as src, sftp.open(part, "ab" if done else "wb") as dst:
            dst.chmod(0o600)  # the user's only from its first byte (the shards are 0600 here)
            dst.set_pipelined(True)
            src.seek(done)
            while True:
                chunk = src.read(1 << 20)
                if not chunk:
                    break
                dst.write(chunk)
                sent += len(chunk)
                self.bytes_sent += len(chunk)
                if on_bytes:
                    on_bytes(len(chunk))
        sftp.posix_rename(part, remote)
        return sent

    def rsync_command(self) -> list[str] | None:
        """The ssh command rsync should use to reach this host with the same trust, identity and route
        Fabric used (OpenSSH with strict host-key checking against our known_hosts), or None when rsync or
        ssh is missing here.

        It names what Fabric resolved from ~/.ssh/config (HostName, User, Port, every IdentityFile, a
        ProxyJump or ProxyCommand) explicitly, and hands ssh the same config file with ``-F``: OpenSSH
        reads the passwd entry's ~/.ssh/config, Fabric the one under $HOME, and a ProxyJump's hops are
        resolved through it."""
        import shutil

        if not (shutil.which("rsync") and shutil.which("ssh")) or self._conn is None:
            return None
        conn = self._conn
        cmd = ["ssh"]
        config = next((os.path.expanduser(p) for p in ("~/.ssh/config", "/etc/ssh/ssh_config")
                       if os.path.isfile(os.path.expanduser(p))), os.devnull)
        cmd += ["-F", config, "-p", str(conn.port), "-l", conn.user, "-o", "BatchMode=yes",
                "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={self.known_hosts_path}",
                "-o", f"ConnectTimeout={max(1, int(self.options.connect_timeout_s))}"]
        keys = conn.connect_kwargs.get("key_filename") or []
        for key in [keys] if isinstance(keys, str) else keys:
            cmd += ["-i", os.path.expanduser(key)]
        if self.options.identity or str(conn.ssh_config.get("identitiesonly", "")).lower() == "yes":
            cmd += ["-o", "IdentitiesOnly=yes"]
        if conn.ssh_config.get("proxyjump"):
            cmd += ["-o", f"ProxyJump={conn.ssh_config['proxyjump']}"]
        elif conn.ssh_config.get("proxycommand"):
            cmd += ["-o", f"ProxyCommand={conn.ssh_config['proxycommand']}"]
        return cmd

    def rsync_destination(self, remote_dir: str) -> str:
        """``user@host:dir/`` for rsync, the host as Fabric resolved it (HostName; IPv6 in brackets)."""
        assert self._conn is not None
        host = f"[{self._conn.host}]" if ":" in self._conn.host else self._conn.host
        return f"{self._conn.user}@{host}:{remote_dir}/"

    def rsync(self, local_dir: str | Path, remote_dir: str, files: list[str]) -> int:
        """Send ``files`` (relative to ``local_dir``) with rsync over ssh, resumable (--partial
        --append-verify). Returns the bytes rsync reports sent."""
        import subprocess

        ssh = self.rsync_command()
        assert ssh is not None and self._conn is not None
        dest = self.rsync_destination(remote_dir)
        proc = subprocess.run(["rsync", "-rt", "--partial", "--append-verify", "--protect-args", "--stats",
                               "--files-from=-", "-e", shlex.join(ssh), f"{local_dir}/", dest],
                              input="\n".join(files) + "\n", capture_output=True, text=True,
                              timeout=self.options.command_timeout_s)
        if proc.returncode != 0:
            raise RemoteFailed(f"{self.label}: rsync exited with {proc.returncode}: {proc.stderr.strip()[-600:]}",
                               hint="run the deploy again (rsync resumes), or check that the host's rsync works")
        sent = 0
        for line in proc.stdout.splitlines():
            if line.startswith("Total bytes sent:"):
                sent = int(line.split(":", 1)[1].strip().replace(",", ""))
        self.bytes_sent += sent
        return sent
