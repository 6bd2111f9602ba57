"""The service on two GPUs (run on the lent device; skipped without two CUDA GPUs): greedy tokens are
checked with the peer inside the decode step's CUDA graph, the answers equal TP1 on the same GPU, a
corrupted hash is a LOCKSTEP FAILURE caught inside the graph in its own step with no wrong token served,
a stalled rank (it sleeps before launching its replay) times out its peer's GPU-side wait, and /metrics
reports the ranks' device step times. V100PLAN_TRANSCRIPT_DIR=$OUT writes what happened there; the
CPU test in tests/engine/test_engine_lockstep_recording.py judges the recording."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.test_service_support import (
    MODEL_ID,
    ServiceProcess,
    prompt_ids,
    reference_until_eos,
    stream_until_fault,
    tokenizer,
    tp1_reference,
    wait_until,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


LONG = {"model": MODEL_ID, "prompt": "Long story", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}


@pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA GPUs in one host")
def test_lockstep_in_the_graph_on_two_gpus():
    svc = ServiceProcess("--device", "cuda:0,cuda:1", "--dtype", "float32", "--enable-fault-injection",
                         "--max-context", "2048", stall_timeout_s=30, allreduce_timeout_s=4)
    rec: dict = {"kind": "lockstep_in_graph_transcript", "date": time.strftime("%Y-%m-%d")}
    try:
        health = svc.wait_healthy(timeout_s=400)
        rec["health"] = health
        d0 = health["decode"]["0"]
        assert d0["mode"] == "graphs" and d0["lockstep"].startswith("in the step's graph")
        # greedy answers equal TP1 on the same GPU
        for prompt in ("The quick brown fox", "Once upon a time"):
            ids = prompt_ids(prompt)
            got = svc.complete(prompt, 48).json()["v100plan"]["token_ids"]
            ref = tp1_reference(tuple(ids), 48, device="cuda:0", dtype="float32")
            assert got == reference_until_eos(ref["token_ids"]), prompt
            rec.setdefault("equal_to_tp1", []).append(prompt)
        # sampled tokens still go through the exchange after the step
        ids = prompt_ids("Random words:")
        got = svc.complete("Random words:", 24, temperature=0.9, seed=7).json()["v100plan"]["token_ids"]
        ref = tp1_reference(tuple(ids), 24, 0.9, 7, device="cuda:0", dtype="float32")
        assert got == reference_until_eos(ref["token_ids"])
        metrics = svc.client.get("/metrics").text
        rec["metrics"] = [line for line in metrics.splitlines() if line.startswith("v100plan_decode_")]
        assert any(line.startswith('v100plan_decode_step_ms{rank="1"}') for line in rec["metrics"])

        # corrupt rank 1's running hash inside the graph of its next step, mid-way through a long greedy stream
        before = svc.wait_healthy()
        text, tail = stream_until_fault(svc, LONG, lambda: svc.inject("corrupt_hash", rank=1))
        assert tail[-1] == {"done": True} and any("error" in e for e in tail)
        long_ref = tp1_reference(tuple(prompt_ids("Long story")), 1500, device="cuda:0", dtype="float32")
        full = tokenizer().decode(long_ref["token_ids"])
        assert text and full.startswith(text)  # every token served was agreed, and right
        failure = [e for e in svc.events("rank_failure") if e["generation"] == before["generation"]][-1]
        rec["corrupt_hash"] = {"failure": failure, "streamed_chars": len(text)}
        assert "LOCKSTEP FAILURE at step" in failure["reason"]
        assert "checked inside the decode step's graph" in failure["reason"] and "hash" in failure["reason"]
        logs = Path(svc.state_dir, "logs")
        r1 = (logs / f"rank1.g{before['generation']}.log").read_text()
        assert "(inside the step's graph)" in r1 and "fault injection: corrupting this rank's hash at step" in r1
        now = svc.wait_healthy(timeout_s=400, newer_than=before["generation"])

        # stall rank 1 before its next replay: rank 0's GPU-side wait runs out
        svc.inject("stall_allreduce", rank=1)
        r = svc.complete("Long story", 50)
        assert r.status_code == 503
        after = svc.wait_healthy(timeout_s=400, newer_than=now["generation"])
        failure = [e for e in svc.events("rank_failure") if e["generation"] == now["generation"]][-1]
        rec["stall"] = {"failure": failure}
        r0 = (logs / f"rank0.g{now['generation']}.log").read_text()
        rec["stall"]["rank0_tail"] = r0.splitlines()[-3:]
        assert failure["cause"] in ("peer_wait", "liveness", "stall", "allreduce")  # the stall scenario's causes
        ids = prompt_ids("The quick brown fox")
        got = svc.complete("The quick brown fox", 16).json()["v100plan"]
        assert got["generation"] == after["generation"]
        assert got["token_ids"] == reference_until_eos(tp1_reference(tuple(ids), 16, device="cuda:0",
                                                                      dtype="float32")["token_ids"])
        wait_until(lambda: svc.events("decode_stats"), 10, what="decode_stats")
        rec["decode_stats"] = svc.events("decode_stats")[-1]
        rec["passed"] = True
    finally:
        log_text = svc.log_text()
        svc.stop()
        out = os.environ.get("V100PLAN_TRANSCRIPT_DIR")
        if out:
            Path(out, "lockstep-gpu-transcript.json").write_text(json.dumps(rec, indent=1, default=str))
            Path(out, "lockstep-gpu-serve.log").write_text(log_text[-100000:])


@pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA GPUs in one host")
def test_a_stalled_rank_fails_its_peers_captured_wait_within_one_deadline():
    """Rank 1 sleeps before launching its next replay: rank 0's GPU-side wait gives up at its deadline
    (4 s here) and every later wait of the same step gives up at once, so rank 0 reports the allreduce
    failure itself, long before the proxy's 30 s stall timeout would."""
    svc = ServiceProcess("--device", "cuda:0,cuda:1", "--dtype", "float32", "--enable-fault-injection",
                         "--max-context", "512", stall_timeout_s=30, allreduce_timeout_s=4)
    try:
        before = svc.wait_healthy(timeout_s=400)
        t0 = time.monotonic()
        svc.inject("stall_allreduce", rank=1)
        r = svc.complete("Long story", 50)
        waited = time.monotonic() - t0
        assert r.status_code == 503
        failure = [e for e in svc.events("rank_failure") if e["generation"] == before["generation"]][-1]
        out = os.environ.get("V100PLAN_TRANSCRIPT_DIR")
        if out:
            Path(out, "stall-gpu.json").write_text(json.dumps({"failure": failure, "waited_s": round(waited, 2)}))
        assert failure["cause"] == "allreduce" and "allreduce failed" in failure["reason"], failure
        assert "device_mailbox_graph: a wait passed 4.0 s on the GPU" in failure["reason"]
        assert waited < 15, waited
        after = svc.wait_healthy(timeout_s=400, newer_than=before["generation"])
        assert svc.complete("The quick brown fox", 8).json()["v100plan"]["generation"] == after["generation"]
    finally:
        svc.stop()
