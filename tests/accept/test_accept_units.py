"""The acceptance suite's pieces that need no service: statistics, verdicts, the case protocol's
status rules, secret scrubbing, the API-key file rule, and the CLI's refusals."""

from __future__ import annotations

import json
import os
import socket

import pytest

from v100plan.accept import functional
from v100plan.accept.cases import Outcome, Repetition, percentile, registry, spread
from v100plan.accept.load import predicted_decode
from v100plan.accept.runner import verdict
from v100plan.commands.suite import read_api_key
from v100plan.qualify.reports import scrub as _scrub


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


def test_spread_ignores_unmeasured_values():
    assert spread([0.2, None, 0.1, 0.6]) == {"median": 0.2, "worst": 0.6, "n": 3}
    assert spread([None, None]) is None


def test_outcome_status_follows_checks_and_repetitions():
    o = Outcome()
    assert o.status == "passed" and o.reason is None
    o.warn("slow")
    assert o.status == "warned" and o.reason == "slow"
    assert o.check(False, "wrong token") is False
    assert o.status == "failed" and o.reason == "wrong token"
    o2 = Outcome(repetitions=[Repetition(1), Repetition(2)])
    o2.repetitions[1].fail("did not recover")
    assert o2.status == "failed" and "repetition 2: did not recover" in o2.reason


def test_verdict_never_passes_what_did_not_run():
    ok = [{"key": "a", "status": "passed"}, {"key": "b", "status": "waived"}]
    assert verdict(ok, None)[0] == "passed"
    assert verdict([{"key": "b", "status": "waived"}], None)[0] == "incomplete"
    assert verdict(ok, "interrupted (Ctrl-C) during load")[0] == "incomplete"
    bad = ok + [{"key": "c", "status": "error"}]
    v, why = verdict(bad, None)
    assert v == "failed" and "c" in why


def test_every_case_has_a_unique_key_and_a_known_group():
    cases = registry()
    keys = [c.key for c in cases]
    assert len(keys) == len(set(keys))
    assert {c.group for c in cases} == {"functional", "fault", "load"}
    faults = {c.key for c in cases if c.group == "fault"}
    assert faults == {"kill_rank1", "kill_rank0", "freeze_rank1", "corrupt_hash", "stall_allreduce",
                      "kill_proxy", "restart_storm", "spec_fault"}
    order = [c.key for c in sorted(cases, key=lambda c: ("functional", "fault", "load").index(c.group))]
    # the serving-feature cases run after the cases they extend
    assert order.index("prefix_reuse") > order.index("rank_logs_agree") and order[-2:] == ["spec_fault", "load"]


def test_stop_sequence_is_taken_past_the_start_of_the_text():
    text = "abcabcXYZ tail"
    stop = functional._pick_stop(text)
    assert stop is not None and text.index(stop) > 0
    assert functional._pick_stop("aaaa") is None  # every piece first occurs at the start


def test_rank_log_request_lines_are_parsed():
    log = ("[rank 0] ready: allreduce gloo\n"
           "[rank 0] request cmpl-1 finish=length steps=17 tokens=16 hash=00ab\n"
           "[rank 0] request cmpl-2 finish=cancelled steps=4 tokens=3 hash=0f\n")
    lines = functional._request_lines(log)
    assert lines["cmpl-2"] == {"finish": "cancelled", "steps": 4, "tokens": 3, "hash": "0f"}
    assert set(lines) == {"cmpl-1", "cmpl-2"}


def test_scrub_removes_secrets_anywhere():
    doc = {"a": ["key sk-PLANTED-1234 echoed"], "b": {"c": "sk-PLANTED-1234"}, "n": 3}
    out = _scrub(doc, ["sk-PLANTED-1234", ""])
    assert "sk-PLANTED-1234" not in json.dumps(out) and out["n"] == 3 and "[redacted]" in out["b"]["c"]


def test_api_key_file_must_be_private(tmp_path):
    f = tmp_path / "key"
    f.write_text("s3cret-key\n")
    os.chmod(f, 0o644)
    with pytest.raises(Exception) as e:
        read_api_key(f)
    assert "readable by other users" in e.value.message and "chmod 600" in e.value.hint
    os.chmod(f, 0o600)
    assert read_api_key(f) == "s3cret-key"
    f.write_text("")
    with pytest.raises(Exception, match="empty"):
        read_api_key(f)


def test_predicted_decode_is_the_recommended_strategy(cli):
    plan = cli.json("plan")
    want = next(s["decode_tok_s"] for s in plan["strategies"] if s["name"] == plan["recommended"])
    assert predicted_decode(plan) == want and want > 0
    assert predicted_decode(None) is None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, code, words", [
    ([], 2, "needs --endpoint"),
    (["--endpoint", "127.0.0.1:8000"], 2, "not an http(s) URL"),
    (["--endpoint", "http://127.0.0.1:1", "--only", "nonsense"], 2, "unknown scenario"),
    (["--endpoint", "http://127.0.0.1:1", "--clients", "0"], 2, "--clients"),
])
def test_accept_refuses_bad_input(cli, args, code, words):
    r = cli("accept", *args)
    assert r.exit_code == code
    assert words in r.stderr


def test_accept_unreachable_endpoint_is_an_environment_problem(cli, tmp_path):
    r = cli("accept", "--endpoint", f"http://127.0.0.1:{_closed_port()}", "--out", tmp_path / "r")
    assert r.exit_code == 4
    assert "cannot accept" in r.stderr and "Hint:" in r.stderr


@pytest.mark.parametrize("device", ["tpu", "cuda:0,cuda:1,cuda:2", "cuda:x"])
def test_qualify_refuses_a_device_it_cannot_use(cli, device):
    r = cli("qualify", "--device", device)
    assert r.exit_code == 2 and "--device" in r.stderr and "Hint:" in r.stderr


def test_qualify_out_must_be_a_directory(cli, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    r = cli("qualify", "--out", f)
    assert r.exit_code == 2 and "is a file" in r.stderr


def test_service_log_events_are_taken_after_the_mark_even_in_a_tail():
    from v100plan.accept.events import events_after as _events_after
    from v100plan.accept.faults import _exited_at_cap, _failure_cause

    old = '{"ts": 1, "event": "rank_failure", "cause": "exit"}'
    log = "\n".join([old, '{"ts": 2, "event": "request"}', "not json",
                     '{"ts": 3, "event": "rank_failure", "cause": "lockstep"}'])
    after = _events_after(log, '{"ts": 2, "event": "request"}')
    assert [e["ts"] for e in after] == [3]
    assert _failure_cause("lockstep")(None, after) is None
    assert "expected" in _failure_cause("exit")(None, after)
    # the mark scrolled out of a tail: every event of the tail counts
    assert len(_events_after(log, '{"ts": 0, "event": "gone"}')) == 3
    storm = [{"event": "rank_start_failed"}, {"event": "exit", "code": 3, "cause": "selftest"}]
    assert _exited_at_cap(None, storm) is None
    # the proxy started afresh reports the exit of the one that gave up (all /control/events still has)
    assert _exited_at_cap(None, [{"event": "previous_exit", "code": 3, "cause": "selftest"}]) is None
    assert "exited 0" in _exited_at_cap(None, [{"event": "rank_start_failed"}, {"event": "exit", "code": 0}])
    assert "no exit" in _exited_at_cap(None, [{"event": "rank_start_failed"}])
    assert "'startup'" in _exited_at_cap(None, [{"event": "exit", "code": 3, "cause": "startup"}])


def test_qualify_serves_tp2_with_the_race_whatever_the_plan_recommends():
    # A two-H200 probe plans the demo model as replicas (allreduce 'none'), which the two-rank engine
    # does not take: qualify serves tp2 with `auto` and the report's notes say what the plan said.
    from v100plan.qualify.phases import note_plan_allreduce

    plan = {"launch": {"strategy": "replicas", "allreduce": "none"},
            "strategies": [{"name": "replicas", "allreduce_path": "none"}, {"name": "tp2", "allreduce_path": "nccl"}]}
    notes: list[str] = []
    note_plan_allreduce(plan, notes)
    assert "allreduce auto" in notes[0] and "replicas (allreduce none)" in notes[0] and "tp2 row names nccl" in notes[0]
    notes = []
    note_plan_allreduce(None, notes)
    assert notes == []


def test_half_precision_answers_are_not_judged_against_a_tp1_run(tmp_path):
    # On two H200s in bfloat16 the demo model's TP2 answers differed from TP1's (near-flat logits, sums
    # rounded in another order): a half-precision service is compared with its own quiet answer, the
    # tp2_equals_tp1 scenario says why it cannot apply, and float32 keeps the exact TP1 check.
    from v100plan.accept.context import AcceptOptions, Context, Target
    from v100plan.accept.functional import _needs_tp2_reference

    def ctx(dtype):
        t = Target(endpoint="http://127.0.0.1:9", model_dir=str(tmp_path),
                   engine={"tp": 2, "devices": ["cuda:0", "cuda:1"], "dtype": dtype})
        c = Context(t, AcceptOptions())
        c.is_engine = True
        return c

    half = ctx("bfloat16")
    assert half.refs.exact is False and half.refs.half_precision == "bfloat16"
    assert "bfloat16" in _needs_tp2_reference(half)
    full = ctx("float32")
    assert full.refs.exact is True and _needs_tp2_reference(full) is None


def test_qualify_serves_the_demo_model_in_float32_on_gpus():
    from v100plan.qualify.local import _dtype

    probe = {"cards": [{"compute_capability": "9.0"}, {"compute_capability": "9.0"}]}
    assert _dtype("cuda", probe, None, demo=True) == "float32"
    assert _dtype("cuda", probe, None) == "bfloat16"
    assert _dtype("cuda", {"cards": [{"compute_capability": "7.0"}] * 2}, None) == "float16"


def test_the_two_h200_bf16_recording_is_what_half_precision_references_now_avoid(tmp_path):
    # tests/fixtures/acceptance/qualify-h200x2-bf16-2026-11-30.json: qualify on two H200s (nvidia-h200-x2,
    # 2026-11-30) serving the demo model in bfloat16 and judging it against a TP1 run: the
    # ranks recovered from every fault (detected within 10 s) yet every fault scenario failed its prefix check and
    # tp2_equals_tp1 failed. Today's rules would not have compared that service with a TP1 run.
    from tests.conftest import FIXTURES
    from v100plan.accept.context import AcceptOptions, Context, Target

    rec = json.loads((FIXTURES / "acceptance" / "qualify-h200x2-bf16-2026-11-30.json").read_text())
    eng = rec["target"]["engine"]
    assert eng["dtype"] == "bfloat16" and eng["devices"] == ["cuda:0", "cuda:1"]
    by_key = {s["key"]: s for s in rec["scenarios"]}
    assert by_key["tp2_equals_tp1"]["status"] == "failed"
    faults = [s for s in rec["scenarios"] if s["group"] == "fault"]
    reps = [r for s in faults for r in s["repetitions"]]
    assert reps and all(r["time_to_detect_s"] < 10.0 and r["time_to_recover_s"] for r in reps)
    ctx = Context(Target(endpoint=rec["target"]["endpoint"], model_dir=str(tmp_path), engine=eng), AcceptOptions())
    assert ctx.refs.exact is False


def test_the_two_h200_float32_runs_fail_only_where_the_pace_beat_the_scenarios_then_pass_them():
    # qualify-h200x2-float32-2026-11-30.json: the full suite on two H200s (float32 demo model): 18 passed and
    # three failed because the service was faster than the scenarios assumed (200 tokens streamed in ~50 ms,
    # before kill_proxy's injection landed; the long prompt's prefill ended within 0.15 s). The next run
    # (qualify-h200x2-subset-2026-11-30.json, --only those three) sized the request from the measured pace
    # and left inside the measured prefill: all three passed. The full passing run came the next day
    # (qualify-h200x2-full-2026-12-01.json, the test below).
    from tests.conftest import FIXTURES

    full = json.loads((FIXTURES / "acceptance" / "qualify-h200x2-float32-2026-11-30.json").read_text())
    sub = json.loads((FIXTURES / "acceptance" / "qualify-h200x2-subset-2026-11-30.json").read_text())
    for rec in (full, sub):
        assert rec["target"]["engine"]["dtype"] == "float32" and rec["target"]["engine"]["devices"] == ["cuda:0", "cuda:1"]
    by = {s["key"]: s for s in full["scenarios"]}
    failed = {k for k, s in by.items() if s["status"] == "failed"}
    assert failed == {"gone_in_prefill", "kill_rank0", "kill_proxy"}
    assert "prefill was too quick" in by["gone_in_prefill"]["reason"]
    assert all("201 events before the fault's end" in r["detail"] for k in ("kill_rank0", "kill_proxy")
               for r in by[k]["repetitions"] if r["status"] == "failed")
    assert by["restart_storm"]["status"] == "passed" and by["tp2_equals_tp1"]["status"] == "passed"
    assert by["openai_client"]["status"] == "waived"
    assert {k for k, s in by.items() if s["status"] == "passed"} | failed | {"openai_client"} == set(by)
    sub_by = {s["key"]: s for s in sub["scenarios"] if s["status"] != "waived"}
    assert {k: s["status"] for k, s in sub_by.items()} == {k: "passed" for k in failed}
    sized = [n for n in sub["target"]["notes"] if n.startswith("the fault scenarios' in-flight request: ")]
    assert sized and int(sized[0].split(": ")[1].split()[0]) == sub["target"]["engine"]["max_context"] // 2
    gone = sub_by["gone_in_prefill"]["metrics"]
    assert gone["client_left_after_s"] < gone["prefill_with_one_token_s"] and gone["tokens_after_leaving"] < 64


@pytest.mark.parametrize("name,dirty", [("qualify-h200x2-full-2026-12-01", False),
                                        ("qualify-h200x2-send-2026-12-01", True)])
def test_the_two_h200_full_run_passes_every_scenario_but_the_waived_openai_client(name, dirty):
    # qualify-h200x2-full-2026-12-01.json (+ .txt): `v100plan qualify` with its defaults on two H200s
    # (nvidia-h200-x2, record-h200x2-qualify.sh with TESTS_S=1, 2026-12-01) at commit 72bcfdb: every scenario
    # ran in one run, 21 passed and openai_client was waived (the carried openai 3.57 needs httpx2, which
    # neither travelled nor is on the host, so `import openai` failed). Faults ran 3 times each on a
    # 1024-token in-flight request sized from the measured pace.
    # qualify-h200x2-send-2026-12-01: the same command ~02:30 UTC on the engine with the exchange sent from the
    # GEMVs, the one-kernel all_gather and the two-kernel in-graph lockstep (the working tree before its commit:
    # the device's copy names its base revision, marked -dirty); the same result.
    import re

    from tests.conftest import FIXTURES

    acc = FIXTURES / "acceptance"
    raw = (acc / f"{name}.json").read_text()
    rec = json.loads(raw)
    console = (acc / f"{name}.txt").read_text()
    # The machine: two H200 (compute capability 9.0) measured by the probe, both serving.
    cards = rec["probe"]["cards"]
    assert [(c["name"], c["compute_capability"]) for c in cards] == [("NVIDIA H200", "9.0")] * 2
    assert rec["probe"]["host"]["gpu_count"] == 2
    eng = rec["target"]["engine"]
    assert eng["devices"] == ["cuda:0", "cuda:1"] and eng["tp"] == 2 and eng["dtype"] == "float32"
    assert rec["provenance"]["git_revision"].endswith("-dirty") == dirty and not rec["partial"]
    # Counts from the scenarios themselves; the summary and the verdict must agree with them.
    counts = {s: sum(1 for sc in rec["scenarios"] if sc["status"] == s) for s in ("passed", "warned", "failed",
                                                                                  "waived", "error")}
    assert counts == {"passed": 21, "warned": 0, "failed": 0, "waived": 1, "error": 0}
    assert rec["summary"] == counts and rec["verdict"] == "passed"
    assert verdict(rec["scenarios"], None)[0] == "passed"
    by = {s["key"]: s for s in rec["scenarios"]}
    assert len(by) == len(rec["scenarios"])
    assert by["openai_client"]["status"] == "waived" and "not installed" in by["openai_client"]["reason"]
    # Every scenario the CPU quick-start qualify ran (qualify-cpu.json, all 22 passed there) ran here too.
    cpu = json.loads((acc / "qualify-cpu.json").read_text())
    assert {s["key"] for s in cpu["scenarios"]} == set(by)
    # Each fault: 3 repetitions, each detected and then answered exactly again.
    faults = [s for s in rec["scenarios"] if s["group"] == "fault"]
    assert len(faults) == 7
    for s in faults:
        reps = s["repetitions"]
        assert len(reps) == 3 and all(r["status"] == "passed" for r in reps), s["key"]
        assert all(0 < r["time_to_detect_s"] <= r["time_to_recover_s"] < 90 for r in reps), s["key"]
    sized = [n for n in rec["target"]["notes"] if n.startswith("the fault scenarios' in-flight request: ")]
    assert sized and int(sized[0].split(": ")[1].split()[0]) == eng["max_context"] // 2 == 1024
    gone = by["gone_in_prefill"]["metrics"]
    assert gone["client_left_after_s"] < gone["prefill_with_one_token_s"] and gone["tokens_after_leaving"] == 0
    load = rec["load"]
    ends = load["outcomes"]
    assert ends.get("correct", 0) + ends.get("cancelled", 0) == load["requests"] == 200
    assert not any(ends.get(k) for k in ("wrong", "lost", "duplicate", "error"))
    # The console agrees, and the command exited 0.
    assert "verdict: PASSED: all 21 scenarios that ran passed; 1 waived" in console
    assert re.search(r"^qualify rc=0 wall_s=\d+$", console, re.M)
    # No secret: the service's key (secrets.token_urlsafe(24), 32 characters) or an auth header.
    for text in (raw, console):
        assert not re.search(r"(?<![\w-])[\w-]{32}(?![\w-])", text)
        assert "Bearer" not in text and "Authorization" not in text and "api_key" not in text


def test_the_openai_waiver_names_a_missing_dependency_of_the_client(monkeypatch, tmp_path):
    # the two-H200 runs of 2026-12-01 waived openai_client as "not installed" while openai was there and its
    # dependency httpx2 was not: the reason now says which module is missing
    import sys

    pkg = tmp_path / "openai"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import v100plan_test_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "openai", raising=False)
    why = functional._needs_openai(None)
    assert why and "needs 'v100plan_test_absent_dependency'" in why and "cannot be imported" in why
    monkeypatch.delitem(sys.modules, "openai", raising=False)
    (pkg / "__init__.py").unlink()
    pkg.rmdir()
    monkeypatch.setitem(sys.modules, "openai", None)  # import openai raises ImportError(name="openai")
    assert functional._needs_openai(None) == "the openai package is not installed (pip install 'v100plan[accept]')"


def test_the_openai_client_scenario_passed_on_a_gpu_host_with_its_dependencies_carried():
    # qualify-h200-openai-2026-12-01.json (+ .txt): `qualify --only openai_client,tp2_equals_tp1` on one H200
    # (nvidia-h200; the two-GPU kind was not lent at that moment), with openai 3.57 and httpx2 carried: the
    # scenario the two-H200 runs had to waive passed (the two ranks on one GPU, device_mailbox).
    from tests.conftest import FIXTURES

    acc = FIXTURES / "acceptance"
    rec = json.loads((acc / "qualify-h200-openai-2026-12-01.json").read_text())
    console = (acc / "qualify-h200-openai-2026-12-01.txt").read_text()
    assert [(c["name"], c["compute_capability"]) for c in rec["probe"]["cards"]] == [("NVIDIA H200", "9.0")]
    assert rec["target"]["engine"]["devices"] == ["cuda:0", "cuda:0"] and rec["target"]["engine"]["tp"] == 2
    by = {s["key"]: s for s in rec["scenarios"]}
    ran = {k for k, s in by.items() if s["status"] != "waived"}
    assert ran == {"openai_client", "tp2_equals_tp1"}
    assert by["openai_client"]["status"] == "passed" and by["openai_client"]["metrics"]["stream_chunks"] > 1
    assert by["tp2_equals_tp1"]["status"] == "passed"
    assert all(s["reason"].startswith("not selected") for k, s in by.items() if k not in ran)
    assert "verdict: PASSED: all 2 scenarios that ran passed; 20 waived" in console and "qualify rc=0" in console


def test_waivers_name_the_accept_option_that_is_missing():
    """A waived scenario says which accept option would run it (--state-dir, --model-dir, --supervised)."""
    from types import SimpleNamespace

    from v100plan.accept import faults, functional

    ctx = SimpleNamespace(is_engine=True, fault_control=True, server="v100plan engine",
                          refs=SimpleNamespace(half_precision=None, exact=False),
                          target=SimpleNamespace(read_rank_logs=None, supervised=False, engine={"tp": 2}))
    assert "accept --state-dir DIR" in functional._needs_rank_logs(ctx)
    assert "accept --model-dir DIR" in functional._needs_tp2_reference(ctx)
    assert "--supervised" in faults._needs_supervisor(ctx)
    assert "--host or run qualify" not in functional._needs_rank_logs(ctx)


@pytest.mark.parametrize("statuses, partial, want", [
    (["passed", "failed", "waived"], None, "failed"), (["passed", "error"], "interrupted (Ctrl-C)", "failed"),
    (["passed", "warned", "waived"], None, "passed"), (["passed"], "interrupted (Ctrl-C) during load", "interrupted")])
def test_the_accept_phase_never_says_passed_beside_failed_scenarios(statuses, partial, want):
    from v100plan.qualify.phases import accept_status

    result = {"scenarios": [{"status": s} for s in statuses], "partial_reason": partial}
    assert accept_status(result) == want
