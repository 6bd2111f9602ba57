"""The service on a GPU: two ranks on one device with the device-memory mailbox, answers equal to
TP1 on the same GPU, recovery after a killed rank (the mailbox's epoch must change). The run on
the lent H200 is recorded in tests/fixtures/service/; the CPU tests below judge that recording.

On the device: V100PLAN_TRANSCRIPT_DIR=$OUT makes the GPU test write its transcript there.
V100PLAN_SERVICE_DEVICE / V100PLAN_SERVICE_ALLREDUCE change the devices and path (e.g.
cuda:0,cuda:1 on a two-GPU host; cpu + host_mailbox to rehearse the script without a GPU).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import pytest

from tests.paths import FIXTURES
from tests.test_service_support import (
    MODEL_ID,
    ServiceProcess,
    prompt_ids,
    reference_until_eos,
    tp1_reference,
)

FIXTURE = FIXTURES / "service" / "h200-device-mailbox-2026-11-29.json"
PROMPTS = ["The quick brown fox", "Once upon a time", "Long story"]
MAX_TOKENS = 32
SAMPLED = {"prompt": "Random words:", "temperature": 0.9, "seed": 4242}


def _device_info() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return info


@pytest.mark.gpu
@pytest.mark.slow
def test_device_mailbox_service_on_one_gpu():
    devices = os.environ.get("V100PLAN_SERVICE_DEVICE", "cuda:0,cuda:0")
    path = os.environ.get("V100PLAN_SERVICE_ALLREDUCE", "device_mailbox")
    ref_device = devices.split(",")[0]
    t0 = time.monotonic()
    svc = ServiceProcess("--device", devices, "--allreduce", path, "--dtype", "float32",
                         "--enable-fault-injection", stall_timeout_s=30, allreduce_timeout_s=10)
    transcript: dict = {"kind": "service_transcript", "date": time.strftime("%Y-%m-%d"), "devices": devices,
                        "requested_allreduce": path, "dtype": "float32", "machine": _device_info(), "exchanges": []}
    try:
        health = svc.wait_healthy(timeout_s=300)
        transcript["start_s"] = round(time.monotonic() - t0, 2)
        transcript["health"] = health
        transcript["ready_line"] = svc.events("ranks_up")[-1]
        assert health["allreduce"] == path

        def ask(prompt: str, **kw) -> dict:
            ids = prompt_ids(prompt)
            t = time.monotonic()
            body = svc.complete(prompt, MAX_TOKENS, **kw).json()
            wall_s = time.monotonic() - t
            ref = tp1_reference(tuple(ids), MAX_TOKENS, kw.get("temperature", 0.0), kw.get("seed"),
                                device=ref_device, dtype="float32")
            expected = reference_until_eos(ref["token_ids"])
            got = body["v100plan"]["token_ids"]
            transcript["exchanges"].append({
                "prompt": prompt, "prompt_ids": ids, **kw, "max_tokens": MAX_TOKENS, "generation": body["v100plan"][
                    "generation"], "token_ids": got, "text": body["choices"][0]["text"],
                "tp1_token_ids": ref["token_ids"], "equal_to_tp1": got == expected, "wall_s": round(wall_s, 3)})
            assert got == expected, (prompt, got, expected)
            return body

        for prompt in PROMPTS:
            ask(prompt)
        ask(SAMPLED["prompt"], temperature=SAMPLED["temperature"], seed=SAMPLED["seed"])

        with svc.client.stream("POST", "/v1/completions", json={"model": MODEL_ID, "prompt": PROMPTS[0],
                                                               "max_tokens": MAX_TOKENS, "temperature": 0,
                                                               "stream": True}) as r:
            streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                               if line.startswith("data: {"))
        assert streamed == transcript["exchanges"][0]["text"]
        transcript["stream_equal_to_non_stream"] = True

        # Kill rank 1: the pair restarts, renegotiates the device mailbox with a new epoch, answers exactly.
        before = svc.wait_healthy()
        svc.inject("kill", rank=1)
        after = svc.wait_healthy(timeout_s=300, newer_than=before["generation"])
        assert after["allreduce"] == path
        transcript["restart"] = {"line": svc.events("restart")[-1], "failure": svc.events("rank_failure")[-1]}
        ask(PROMPTS[1])
        transcript["metrics"] = svc.client.get("/metrics").text
        transcript["requests"] = [e for e in svc.events("request") if e.get("id")]
    finally:
        log_text = svc.log_text()  # before stop(): it removes the state directory
        svc.stop()
        out = os.environ.get("V100PLAN_TRANSCRIPT_DIR")
        if out:
            Path(out, "service-transcript.json").write_text(json.dumps(transcript, indent=1))
            Path(out, "service-serve.log").write_text(log_text[-200000:])


def test_recorded_gpu_run_answered_like_tp1_on_the_gpu_and_on_cpu():
    # A deleted recording fails here (no skip): the CPU suite is what judges the GPU run.
    rec = json.loads(FIXTURE.read_text())
    assert rec["health"]["allreduce"] == "device_mailbox" and rec["devices"] == "cuda:0,cuda:0"
    assert rec["restart"]["line"]["allreduce"] == "device_mailbox"
    assert rec["restart"]["line"]["generation"] > rec["health"]["generation"]
    assert len(rec["exchanges"]) == len(PROMPTS) + 2
    for ex in rec["exchanges"]:
        assert ex["equal_to_tp1"] and ex["token_ids"] == reference_until_eos(ex["tp1_token_ids"])
        # The same model on CPU: the prompt ids and the greedy answers agree across machines.
        assert ex["prompt_ids"] == prompt_ids(ex["prompt"])
        if "temperature" not in ex:
            cpu = tp1_reference(tuple(ex["prompt_ids"]), ex["max_tokens"])["token_ids"]
            assert ex["token_ids"] == reference_until_eos(cpu)
