"""The rank protocol's spelling and parsing, and the engine's command table."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from engine.service import protocol
from tests.engine_helpers import REPO


def test_round_trip_of_every_constructor():
    msgs = [protocol.ready(0, 1, 2, "gloo", "passed", None, 64, 256), protocol.fatal("x"),
            protocol.progress("r", 4, 1), protocol.token("r", 0, 5, 2), protocol.done("r", "stop", 3, 1),
            protocol.error("r", "bad"), protocol.pong(3, False), protocol.fault_armed("exit", 2),
            protocol.generate("r", [1, 2], 3, seed=4, stop_token_ids=[2]), protocol.cancel("r"),
            protocol.ping(), protocol.fault("corrupt_hash", None)]
    for m in msgs:
        line = protocol.encode(m)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert protocol.decode(line.rstrip(b"\n")) == m


@pytest.mark.parametrize("line,why", [
    (b"not json", "not a JSON line"),
    (b'{"type": "launch"}', "unknown message type"),
    (b'{"type": "token", "id": "r"}', "token message lacks step, token_id, counter"),
])
def test_bad_lines_are_refused_with_the_reason(line, why):
    with pytest.raises(protocol.ProtocolError, match=why):
        protocol.decode(line)


def test_constructors_refuse_unknown_values():
    with pytest.raises(ValueError, match="finish_reason"):
        protocol.done("r", "timeout", 1, 1)
    with pytest.raises(ValueError, match="fault must be one of"):
        protocol.fault("reboot")


def test_line_socket_splits_lines_reports_timeout_and_eof():
    a, b = socket.socketpair()
    left, right = protocol.LineSocket(a), protocol.LineSocket(b)
    b.sendall(protocol.encode(protocol.ping()) + protocol.encode(protocol.cancel("x"))[:5])
    assert left.recv(timeout_s=2) == {"type": "ping"}
    with pytest.raises(TimeoutError):
        left.recv(timeout_s=0.2)  # half a line is not a message
    b.sendall(protocol.encode(protocol.cancel("x"))[5:])
    assert left.recv(timeout_s=2) == {"type": "cancel", "id": "x"}
    right.close()
    with pytest.raises(protocol.ProtocolError, match="closed"):
        left.recv(timeout_s=2)


def test_rank_client_waits_for_the_socket_and_reports_fatal(tmp_path):
    path = str(tmp_path / "r.sock")

    def server():
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        c, _ = srv.accept()
        c.sendall(protocol.encode(protocol.fatal("start-up failed: no weights")))
        c.close()
        srv.close()

    t = threading.Timer(0.3, server)  # the socket appears after the client started trying
    t.start()
    client = protocol.RankClient(path, connect_timeout_s=10)
    with pytest.raises(protocol.ProtocolError, match="no weights"):
        client.wait_ready(timeout_s=10)
    client.close()
    t.join()
    assert protocol.socket_path_ok("/tmp/" + "x" * 120) is not None


def test_engine_command_table():
    r = subprocess.run([sys.executable, "-m", "engine"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "make-demo-model" in r.stdout and "rank" in r.stdout
    r = subprocess.run([sys.executable, "-m", "engine", "nope"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown command 'nope'" in r.stderr
