"""Two rank processes on CPU: protocol, bit-identical ranks, self-test failure and fallback, lockstep
failure, cancellation, stalls and injected exits."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from engine.allreduce.host_mailbox import mailbox_file
from engine.service import protocol
from tests import engine_helpers
from tests.engine_helpers import REPO

demo_dir = engine_helpers.demo_dir
PROMPT_IDS = [1, 49, 78, 148, 183, 104, 107, 78, 218]


class Ranks:
    """Two `python -m engine rank` processes and a protocol client for each (not yet waited for)."""

    def __init__(self, model, *extra, allreduce="host_mailbox", timeout_s=20):
        self.dir = tempfile.mkdtemp(prefix="v100plan-t-", dir="/tmp")
        self.procs = []
        for r in range(2):
            cmd = [sys.executable, "-m", "engine", "rank", "--model", str(model), "--rank", str(r), "--world", "2",
                   "--rendezvous", os.path.join(self.dir, "rdv"), "--control-socket", self.sock(r),
                   "--allreduce", allreduce, "--max-context", "256", "--allreduce-timeout-s", str(timeout_s),
                   *extra]
            self.procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                               text=True))
        self.clients = [protocol.RankClient(self.sock(r), connect_timeout_s=60) for r in range(2)]

    def sock(self, r):
        return os.path.join(self.dir, f"r{r}.sock")

    def both(self, msg):
        for c in self.clients:
            c.send(msg)

    def until(self, r, types, timeout_s=60):
        """Messages from rank r up to and including the first whose type is in ``types``."""
        seen = []
        while True:
            m = self.clients[r].recv(timeout_s)
            seen.append(m)
            if m["type"] in types:
                return seen

    def wait(self, timeout_s=60):
        codes = [p.wait(timeout=timeout_s) for p in self.procs]
        errs = [p.stderr.read() for p in self.procs]
        return codes, errs

    def close(self):
        for c in self.clients:
            c.close()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def pair(demo_dir):
    """One healthy pair with fault injection enabled, shared by the tests that leave it healthy."""
    rk = Ranks(demo_dir, "--enable-fault-injection", "--prefill-chunk", "4")
    rk.ready = [c.wait_ready(timeout_s=120) for c in rk.clients]
    yield rk
    rk.close()


def test_ready_reports_path_selftest_and_socket_is_private(pair):
    for r, msg in enumerate(pair.ready):
        assert msg["rank"] == r and msg["allreduce"] == "host_mailbox" and msg["selftest"] == "passed"
        assert msg["vocab_size"] == 256 and msg["max_context"] == 256
        assert os.stat(pair.sock(r)).st_mode & 0o777 == 0o600
        # Mapped by both ranks, then unlinked: a rank that dies leaves nothing in /dev/shm.
        assert not os.path.exists(mailbox_file(os.path.join(pair.dir, "rdv"), 0, r))


def test_generate_streams_progress_tokens_done_on_both_ranks(pair):
    pair.both(protocol.generate("a1", PROMPT_IDS, 12))
    msgs = [pair.until(r, ("done", "error", "fatal")) for r in range(2)]
    for r in range(2):
        kinds = [m["type"] for m in msgs[r]]
        assert kinds.count("progress") == 3  # 9 prompt tokens in chunks of 4
        assert kinds.count("token") == 12 and kinds[-1] == "done"
        done = msgs[r][-1]
        assert done["finish_reason"] == "length" and done["prompt_tokens"] == 9 and done["completion_tokens"] == 12
        counters = [m["counter"] for m in msgs[r] if "counter" in m]
        assert counters == sorted(counters) and len(set(counters)) == len(counters)
    tok = [[m["token_id"] for m in msgs[r] if m["type"] == "token"] for r in range(2)]
    assert tok[0] == tok[1]


def test_ping_answers_while_idle(pair):
    pong = pair.clients[0].ping()
    assert pong["busy"] is False and pong["counter"] > 0


def test_cancel_sent_to_one_rank_stops_both_on_the_same_step(pair):
    pair.both(protocol.generate("c1", PROMPT_IDS, 200))
    first = pair.until(0, ("token",))
    assert first[-1]["step"] == 0
    pair.clients[0].send(protocol.cancel("c1"))  # only rank 0 hears it: the OR in lockstep tells rank 1
    ends = [pair.until(r, ("done",)) for r in range(2)]
    done = [e[-1] for e in ends]
    assert done[0]["finish_reason"] == done[1]["finish_reason"] == "cancelled"
    assert done[0]["completion_tokens"] == done[1]["completion_tokens"] < 200


def test_stop_tokens_and_sampling_agree_across_ranks(pair):
    pair.both(protocol.generate("s1", PROMPT_IDS, 30, temperature=1.2, top_p=0.9, seed=9))
    ends = [pair.until(r, ("done",)) for r in range(2)]
    toks = [[m["token_id"] for m in e if m["type"] == "token"] for e in ends]
    assert toks[0] == toks[1] and len(toks[0]) == 30
    stop = toks[0][5]
    pair.both(protocol.generate("s2", PROMPT_IDS, 30, temperature=1.2, top_p=0.9, seed=9, stop_token_ids=[stop]))
    ends = [pair.until(r, ("done",)) for r in range(2)]
    assert ends[0][-1]["finish_reason"] == "stop"
    assert ends[0][-1]["completion_tokens"] == toks[0].index(stop) + 1


def test_request_errors_are_reported_not_fatal(pair):
    pair.both(protocol.generate("e1", list(range(1, 250)) * 2, 5))  # longer than max_context 256
    for r in range(2):
        assert pair.until(r, ("error",))[-1]["message"].startswith("prompt of 498 tokens")
    assert pair.clients[1].ping()["busy"] is False


def test_lockstep_mismatch_stops_both_ranks(pair):
    """Last user of the shared pair: a corrupted hash on rank 1 at step 3 ends both processes."""
    pair.clients[1].send(protocol.fault("corrupt_hash", 3))
    assert pair.until(1, ("fault_armed",))[-1]["what"] == "corrupt_hash"
    pair.both(protocol.generate("l1", PROMPT_IDS, 20))
    for r in range(2):
        msgs = pair.until(r, ("fatal", "done"))
        assert msgs[-1]["type"] == "fatal" and "LOCKSTEP FAILURE" in msgs[-1]["message"]
        assert [m["step"] for m in msgs if m["type"] == "token"] == [0, 1, 2]  # step 3 never handed out
    codes, errs = pair.wait()
    assert codes == [3, 3]
    assert all("LOCKSTEP FAILURE" in e for e in errs)


def test_forced_selftest_failure_falls_back_under_auto(demo_dir):
    rk = Ranks(demo_dir, "--enable-fault-injection", "--fail-selftest", "host_mailbox", allreduce="auto")
    try:
        ready = [c.wait_ready(timeout_s=120) for c in rk.clients]
        assert [m["allreduce"] for m in ready] == ["gloo", "gloo"]
        rk.both(protocol.generate("f1", PROMPT_IDS, 6))
        toks = [[m["token_id"] for m in rk.until(r, ("done",)) if m["type"] == "token"] for r in range(2)]
        assert toks[0] == toks[1] and len(toks[0]) == 6
    finally:
        rk.close()
    _, errs = rk.wait()
    assert "self-test host_mailbox: rank 0: allreduce_sum of 8k known data is not bit-exact;" in errs[0]
    assert "(forced by fault injection)" in errs[0]


def test_explicit_path_that_fails_its_selftest_stops_startup(demo_dir):
    rk = Ranks(demo_dir, "--enable-fault-injection", "--fail-selftest", "host_mailbox", allreduce="host_mailbox")
    for c in rk.clients:
        with pytest.raises(protocol.ProtocolError, match="no allreduce path passed its self-test"):
            c.wait_ready(timeout_s=120)
    codes, _ = rk.wait()
    assert codes == [1, 1]
    rk.close()


def test_device_mailbox_without_cuda_is_refused_with_the_reason(demo_dir):
    rk = Ranks(demo_dir, allreduce="device_mailbox")
    for c in rk.clients:
        with pytest.raises(protocol.ProtocolError, match="the device mailbox needs CUDA devices"):
            c.wait_ready(timeout_s=120)
    assert rk.wait()[0] == [1, 1]
    rk.close()


def test_fault_hooks_are_off_unless_enabled(demo_dir):
    rk = Ranks(demo_dir, allreduce="gloo")
    try:
        [c.wait_ready(timeout_s=120) for c in rk.clients]
        rk.clients[0].send(protocol.fault("exit", None))
        assert "fault injection is disabled" in rk.until(0, ("error",))[-1]["message"]
    finally:
        rk.close()


@pytest.mark.parametrize("allreduce", ["host_mailbox", "gloo"])
def test_stalled_or_exited_peer_is_an_error_within_the_timeout(demo_dir, allreduce):
    rk = Ranks(demo_dir, "--enable-fault-injection", allreduce=allreduce, timeout_s=2)
    try:
        [c.wait_ready(timeout_s=120) for c in rk.clients]
        rk.clients[1].send(protocol.fault("stall_allreduce" if allreduce == "host_mailbox" else "exit", 2))
        rk.until(1, ("fault_armed",))
        t0 = time.monotonic()
        rk.both(protocol.generate("t1", PROMPT_IDS, 10))
        msgs = rk.until(0, ("fatal", "done"), timeout_s=60)
        assert msgs[-1]["type"] == "fatal" and "allreduce" in msgs[-1]["message"]
        assert time.monotonic() - t0 < 30
        assert rk.procs[0].wait(timeout=30) == 4
    finally:
        for p in rk.procs:
            p.kill()
        rk.close()
    if allreduce == "gloo":
        assert rk.procs[1].returncode == 17
