"""The service's pure parts, without processes: stop strings and streamed text, the watchdog's
verdicts, the restart budget, the Prometheus text, and the serve flags' refusals."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.service import watchdog
from engine.service.proxy_metrics import Metrics
from engine.service.proxy_text import ModelText, TextAssembler
from engine.service.serve_config import ServeConfigError, add_serve_arguments, config_from_args, parse_devices
from engine.service.supervise import supervisord_conf, systemd_unit
from tests.test_service_support import demo_model


class _CharTokenizer:
    """One character per token id (id = code point), for exact control over token boundaries."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


TEXT = ModelText(model_id="m", vocab_size=0x3000, eos_token_ids=(0,), tokenizer=_CharTokenizer())


def _feed(asm: TextAssembler, text: str) -> list[str]:
    return [asm.add(ord(c)) for c in text]


def test_stop_string_spanning_tokens_is_never_shown():
    asm = TextAssembler(TEXT, ["END"], TEXT.eos_token_ids)
    deltas = _feed(asm, "abcEN")
    assert "".join(deltas) == "abc"  # "EN" is held back: it may start "END"
    assert asm.add(ord("D")) == "" and asm.stopped
    assert asm.flush() == "" and asm.emitted == "abc"
    assert asm.add(ord("x")) == ""  # tokens after the stop (before the ranks stop) are dropped


def test_held_back_text_is_released_when_it_is_not_a_stop():
    asm = TextAssembler(TEXT, ["END"], TEXT.eos_token_ids)
    out = "".join(_feed(asm, "xENy"))
    assert out == "xE" and asm.flush() == "Ny" and not asm.stopped


def test_earliest_of_several_stops_wins_and_eos_is_not_text():
    asm = TextAssembler(TEXT, ["zz", "q"], TEXT.eos_token_ids)
    shown = "".join(_feed(asm, "ab"))
    assert asm.add(0) == ""  # end of sequence: ends the answer, adds no text
    assert shown + asm.flush() == "ab" and asm.ids == [97, 98, 0]
    asm2 = TextAssembler(TEXT, ["zz", "q"], ())
    _feed(asm2, "azzq")
    assert asm2.stopped and asm2.emitted == "a"


def test_no_stop_strings_stream_every_token_at_once():
    asm = TextAssembler(TEXT, [], ())
    assert _feed(asm, "hello") == list("hello")


def test_demo_tokenizer_pieces_concatenate_to_the_whole():
    from engine.service.proxy_text import load_model_text

    text = load_model_text(demo_model(), None)
    assert text.model_id == "v100plan-demo" and text.eos_token_ids == (2, 7)
    ids = text.encode_prompt("Hello world, streaming text")[1:]
    asm = TextAssembler(text, [], text.eos_token_ids)
    assert "".join(asm.add(i) for i in ids) + asm.flush() == text.decode(ids)


def _link(rank, *, exited=None, eof=False, fatal=None, cause=None, last=0.0, ping=None, progress=None, wait_s=0.0):
    proc = SimpleNamespace(returncode=exited, pid=1000 + rank)
    return SimpleNamespace(rank=rank, proc=proc, pid=proc.pid, exited=exited is not None, eof=eof,
                           fatal_message=fatal, fatal_cause=cause, last_message_monotonic=last, last_counter=7,
                           last_progress_monotonic=last if progress is None else progress,
                           ping_sent_monotonic=ping, wait_s=wait_s)


def _pair(*links):
    return SimpleNamespace(links=list(links))


def test_watchdog_verdicts_carry_a_typed_cause():
    from engine.service.causes import Cause

    def verdict(pair, *args, **kw):
        f = watchdog.pair_failure(pair, *args, **kw)
        return (f.cause, f.rank, f.reason) if f is not None else None

    ok = _pair(_link(0, last=99.0), _link(1, last=99.0))
    assert verdict(ok, busy_since_monotonic=98.0, stall_timeout_s=5, now=100.0) is None
    cause, rank, reason = verdict(_pair(_link(0, last=99.0), _link(1, exited=-9, last=99.0)), None, 5, now=100.0)
    assert (cause, rank) == (Cause.SIGNAL, 1) and "rank 1 (pid 1001) exited with code -9" in reason
    assert verdict(_pair(_link(0, last=99.0), _link(1, exited=17, last=99.0)), None, 5, now=100.0)[:2] == \
        (Cause.EXIT, 1)
    # The rank that died is the origin, not its peer whose allreduce then failed.
    killed = _pair(_link(0, fatal="allreduce failed: peer gone", cause=Cause.ALLREDUCE), _link(1, eof=True))
    assert verdict(killed, None, 5, now=100.0)[:2] == (Cause.EXIT, 1)
    assert verdict(_pair(_link(0, fatal="allreduce failed: timed out", cause=Cause.ALLREDUCE), _link(1)),
                   None, 5, now=100.0)[:2] == (Cause.ALLREDUCE, 0)
    # A lockstep failure wins over the exit that follows it, whatever the text says.
    lock = _pair(_link(0, fatal="step 3 disagrees", cause=Cause.LOCKSTEP, exited=3), _link(1, eof=True))
    assert verdict(lock, None, 5, now=100.0)[:2] == (Cause.LOCKSTEP, 0)
    assert verdict(_pair(_link(0, exited=3), _link(1)), None, 5, now=100.0)[0] is Cause.LOCKSTEP
    # Busy: a rank silent longer than the stall timeout since the request started.
    stalled = _pair(_link(0, last=99.0), _link(1, last=90.0))
    cause, rank, reason = verdict(stalled, 94.0, 5, now=100.0)
    assert (cause, rank) == (Cause.STALL, 1) and "rank 1 (pid 1001) made no progress for 6.0 s" in reason
    assert verdict(stalled, 96.0, 5, now=100.0) is None  # the request started 4 s ago
    # Heartbeats: silence is liveness; a live rank waiting for its peer names the peer.
    assert verdict(stalled, 94.0, 50, now=100.0, liveness_timeout_s=3)[:2] == (Cause.LIVENESS, 1)
    waiting = _pair(_link(0, last=99.9, wait_s=3.5), _link(1, last=99.9))
    assert verdict(waiting, 99.0, 50, now=100.0, liveness_timeout_s=3)[:2] == (Cause.PEER_WAIT, 1)
    # Heartbeats keep coming from a rank whose counter does not move: still no progress.
    beating = _pair(_link(0, last=99.9), _link(1, last=99.9, progress=90.0))
    assert verdict(beating, 94.0, 5, now=100.0, liveness_timeout_s=3)[0] is Cause.STALL
    # Idle: an unanswered ping older than the stall timeout.
    frozen = _pair(_link(0, ping=94.0), _link(1))
    cause, _, reason = verdict(frozen, None, 5, now=100.0)
    assert cause is Cause.STALL and "did not answer a ping" in reason
    assert verdict(frozen, None, 10, now=100.0) is None


def test_one_fault_table_for_the_control_the_ranks_and_the_suite():
    from engine.service import control, protocol
    from engine.service.causes import ACTIONS, FAULTS, RANK_HOOKS, SCENARIOS, SIGNAL_ACTIONS

    assert set(control.SIGNALS) == set(SIGNAL_ACTIONS)
    assert set(RANK_HOOKS) | set(SIGNAL_ACTIONS) | {"kill_proxy", "fail_starts"} == set(ACTIONS)
    for hook in RANK_HOOKS:
        assert protocol.fault(hook)["what"] == hook
    with pytest.raises(ValueError):
        protocol.fault("kill")  # a signal, not a hook the rank arms
    assert len({f.action for f in FAULTS}) == len(FAULTS)
    for sc in SCENARIOS:
        assert sc.action in ACTIONS and sc.detected_by
    assert protocol.fatal("x")["cause"] == "startup"


def test_restart_budget_counts_consecutive_failures_only():
    b = watchdog.RestartBudget(2)
    for came_up in (False, False, True, False, False):
        b.record(came_up)
        assert not b.exhausted
    b.record(False)
    assert b.exhausted and b.consecutive_failures == 3
    assert watchdog.RestartBudget(0).backoff_s() == 0.5


def test_metrics_through_prometheus_client():
    from prometheus_client.parser import text_string_to_metric_families

    m = Metrics()
    m.inc("v100plan_requests_total", endpoint="/v1/completions", status="200")
    m.inc("v100plan_requests_total", endpoint="/v1/completions", status="200")
    m.set_only("v100plan_allreduce_path", 1, path="gloo")
    m.set_only("v100plan_allreduce_path", 1, path="host_mailbox")
    m.inc("v100plan_rank_restarts_total", cause="signal")
    m.inc("v100plan_request_outcomes_total", outcome="length")
    for s in (0.04, 0.2, 3.0):
        m.observe("v100plan_time_to_first_token_seconds", s)
    m.observe("v100plan_time_per_output_token_seconds", 0.004)
    text = m.render()
    assert 'v100plan_requests_total{endpoint="/v1/completions",status="200"} 2.0\n' in text
    assert 'path="host_mailbox"} 1.0' in text and 'path="gloo"' not in text
    assert "# TYPE v100plan_ranks_up gauge" in text and "v100plan_lockstep_failures_total 0.0" in text
    assert 'v100plan_rank_restarts_total{cause="signal"} 1.0' in text and "_created" not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}  # the official parser reads it all
    ttft = families["v100plan_time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in ttft.samples if s.name.endswith("_bucket")}
    assert buckets["0.05"] == 1 and buckets["0.25"] == 2 and buckets["+Inf"] == 3
    assert m.get("v100plan_time_to_first_token_seconds") == 3
    assert m.get("v100plan_requests_total", endpoint="/v1/completions", status="200") == 2
    assert families["v100plan_request_outcomes"].type == "counter"


def _cfg(*argv):
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return config_from_args(p.parse_args(["--model", demo_model(), *argv]))


def test_serve_flags(tmp_path):
    cfg = _cfg("--stall-timeout-s", "8")
    assert cfg.devices == ("cpu", "cpu") and cfg.dtype == "float32" and cfg.ping_interval_s == 2.0
    assert _cfg("--device", "cuda").devices == ("cuda:0", "cuda:1")
    assert _cfg("--device", "cuda:0,cuda:0").dtype == "auto"  # each rank applies engine.dtype_rule to its card
    with pytest.raises(ServeConfigError, match="not a loopback address"):
        _cfg("--host", "10.0.0.5")
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    key.chmod(0o600)
    assert _cfg("--host", "10.0.0.5", "--api-key-file", str(key)).api_key == "s3cret"
    with pytest.raises(ServeConfigError):
        parse_devices("gpu0")


def test_supervisor_files_restart_the_proxy_and_reach_the_ranks():
    conf = supervisord_conf("/srv/state%x", ["/usr/bin/python3", "-m", "engine", "serve", "--port", "8000"])
    assert "command=/usr/bin/python3 -m engine serve --port 8000" in conf
    # SIGTERM to the proxy alone (it stops its watchdog before its ranks); SIGKILL to the group.
    assert "autorestart=unexpected" in conf and "stopasgroup=false" in conf and "killasgroup=true" in conf
    assert "exitcodes=2,4" in conf  # serve's exits no restart mends (bad input, cannot serve here): left down
    assert "umask=077" in conf
    assert "file=/srv/state%%x/supervisor.sock" in conf  # '%' escaped for supervisord's expansion
    unit = systemd_unit(["/usr/bin/python3", "-m", "engine", "serve"])
    assert "Restart=always" in unit and "KillMode=mixed" in unit and "RestartPreventExitStatus=2 4" in unit


def test_the_default_body_limit_fits_a_prompt_that_fills_the_context(tmp_path):
    # a 256K-token prompt as token ids is ~1.8 MB: a fixed 1 MiB limit would refuse what --max-context allows
    big = _cfg("--max-context", "262144").body_limit_bytes
    assert big >= len(",".join(["248319"] * 262144)) + 200
    assert _cfg("--max-context", "4096").body_limit_bytes == 1 << 20  # never below 1 MiB
    assert _cfg("--max-context", "262144", "--body-limit-bytes", "65536").body_limit_bytes == 65536
    native = json.loads((Path(demo_model()) / "config.json").read_text())["max_position_embeddings"]
    assert _cfg().body_limit_bytes == max(1 << 20, 16 * native)


def test_one_clients_prompts_in_the_text_workers_default_to_the_served_concurrency():
    """--text-jobs-per-client's default follows the served N (at least 2), so one client (one address, one key: an
    agent host, a team behind one proxy) can fill every slot; a flag fixes it; one past the limit is ClientBusy
    (429) before any worker is asked."""
    import asyncio

    from engine.service.proxy_text_pool import ClientBusy, TextPool

    served = {"n": None}
    pool = TextPool("unused", None, 1, None, concurrency=lambda: served["n"])
    assert pool.per_client == 2  # before the ranks chose N
    served["n"] = 8
    assert pool.per_client == 8
    served["n"] = 1
    assert pool.per_client == 2
    assert TextPool("unused", None, 1, 3, concurrency=lambda: 8).per_client == 3
    assert _cfg().text_jobs_per_client is None and _cfg("--text-jobs-per-client", "5").text_jobs_per_client == 5
    with pytest.raises(ServeConfigError, match="--text-jobs-per-client must be 1 or more"):
        _cfg("--text-jobs-per-client", "0")
    served["n"] = 4
    pool._in_flight[("127.0.0.1", False)] = 4

    def never(*_):
        raise AssertionError("a worker was asked")

    with pytest.raises(ClientBusy, match=r"already has 4 prompts .*--text-jobs-per-client 4: the served concurrency"):
        asyncio.run(pool._run(("127.0.0.1", False), never))
    assert pool._pool is None  # no worker was started for it
