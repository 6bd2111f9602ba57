"""The fork server outlives a killed proxy and is taken over by the next one (engine/service/rank_forks.py):
a real `python -m engine.service.rank_forks --adopt-socket PATH` whose stdin ends without "bye" (its proxy
SIGKILLed) SIGKILLs the ranks it forked, refuses another user on its socket, serves the next proxy of this
user over the socket, and exits on "bye" with its socket removed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from tests.test_service_support import REPO, pid_alive, short_dir, wait_until


def _lines(sock: socket.socket):
    buf = b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)
        chunk = sock.recv(65536)
        if not chunk:
            return
        buf += chunk


def test_a_killed_proxys_fork_server_ends_its_ranks_and_serves_the_next_proxy():
    d = short_dir("adopt")
    os.chmod(d, 0o700)
    path = os.path.join(d, "forks.sock")
    server = subprocess.Popen([sys.executable, "-m", "engine.service.rank_forks", "--adopt-socket", path], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert json.loads(server.stdout.readline()) == {"ready": True}
        # a rank that stays up: its start fails (no such model) and it then waits 30 s for a proxy to tell
        argv = ["--model", os.path.join(d, "none"), "--rank", "0", "--rendezvous", d,
                "--control-socket", os.path.join(d, "r0.sock")]
        server.stdin.write((json.dumps({"argv": argv, "log": os.path.join(d, "r.log")}) + "\n").encode())
        server.stdin.flush()
        rank = json.loads(server.stdout.readline())["pid"]
        time.sleep(0.5)
        assert pid_alive(rank)
        st = os.stat(path)
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
        server.stdin.close()  # the proxy is gone (no "bye"): its ranks are SIGKILLed, the server waits
        wait_until(lambda: not pid_alive(rank), 10, what="the killed proxy's rank to end")
        assert server.poll() is None

        if os.getuid() == 0 and os.path.exists("/usr/bin/python3"):  # another user (nobody's python: the system one) cannot even reach the socket (0600 in a 0700 directory)
            probe = subprocess.run(["/usr/bin/python3", "-c", f"import socket; socket.socket(socket.AF_UNIX).connect({path!r})"],
                                   preexec_fn=lambda: os.setuid(65534), capture_output=True, text=True, timeout=30)
            assert probe.returncode != 0 and "Permission" in probe.stderr, probe.stderr

        from engine.service.rank_forks import connect_waiting

        got = connect_waiting(path)
        assert got is not None and got[1] == server.pid  # the kernel's word for the peer: that server
        sock, _ = got
        sock.setblocking(True)
        replies = _lines(sock)
        assert next(replies) == {"ready": True}
        sock.sendall(b'{"bye": true}\n')
        assert server.wait(timeout=10) == 0
        assert not os.path.exists(path)
        sock.close()
    finally:
        if server.poll() is None:  # our own child, not reaped: this pid is the server we started
            server.send_signal(signal.SIGKILL)
            server.wait()


def test_nobody_adopting_it_the_server_exits():
    d = short_dir("adopt")
    path = os.path.join(d, "forks.sock")
    code = ("import engine.service.rank_forks as f, sys; f.ADOPT_WAIT_S = 1.0; "
            f"sys.exit(f.main(['--adopt-socket', {path!r}]))")
    server = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert json.loads(server.stdout.readline()) == {"ready": True}
        server.stdin.close()
        assert server.wait(timeout=20) == 0 and not os.path.exists(path)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGKILL)
            server.wait()


def test_a_proxy_taking_over_a_waiting_fork_server_does_not_check_cuda_again(tmp_path):
    # On a host without CUDA, `--device cuda` is refused at once (exit 4)... unless a fork server of this state dir
    # waits for adoption: the proxy its supervisor just restarted checked the host, and importing torch to check
    # again is most of a GPU host's proxy restart. The waiting server is found by spawn_early().
    from engine.service import serve
    from engine.service.rank_forks import RankForks
    from engine.service.serve_config import EXIT_CANNOT_SERVE

    class Cfg:
        devices = ("cuda:0", "cuda:1")

    assert serve._cannot_serve(Cfg()) == EXIT_CANNOT_SERVE  # this CI host has no CUDA
    assert serve._cannot_serve(Cfg(), cuda_checked=True) is None
    d = short_dir("adopt")
    os.chmod(d, 0o700)
    path = os.path.join(d, "forks.sock")
    forks = RankForks(str(tmp_path / "forks.log"), adopt_socket=path)
    assert not forks.adopting
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # stands for a server waiting on its socket
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(1)
    try:
        forks.spawn_early()
        assert forks.adopting and forks._early is None  # nothing new was started: the waiting one is taken
    finally:
        if forks._waiting is not None:
            forks._waiting[0].close()
        listener.close()
