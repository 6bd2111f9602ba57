"""The service reports what its ranks' decode step achieves: real rank processes on CPU (the demo model,
eager steps), one service for the module. The figures come from the run (the ranks' own timings and a
read bandwidth they measured at start, or one given by V100PLAN_ENGINE_READ_BW_GBPS), never constants."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from engine.service.proxy_decode import DecodeReport
from engine.service.proxy_log import StructuredLog
from engine.service.proxy_metrics import Metrics
from tests.test_service_support import ServiceProcess, prompt_ids, wait_until

KEY = "stats-key-0b7e"
GAUGE = re.compile(r'^(v100plan_decode_\w+)\{([^}]*)\} (\S+)$')


def _gauges(text: str) -> dict[str, dict[str, float]]:
    """name -> {labels: value} for the decode gauges in a /metrics body."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = GAUGE.match(line)
        if m:
            out.setdefault(m.group(1), {})[m.group(2)] = float(m.group(3))
    return out


@pytest.fixture(scope="module")
def svc():
    s = ServiceProcess("--max-context", "512", api_key=KEY, stall_timeout_s=60, allreduce_timeout_s=30)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.mark.slow
def test_metrics_health_and_log_show_decode_figures(svc):
    before = _gauges(svc.client.get("/metrics").text)
    # Before any request: how the ranks decode and their measured read bandwidth, but no speed yet.
    assert set(before["v100plan_decode_mode"]) == {'kernels="eager",mode="eager",rank="0"',
                                                   'kernels="eager",mode="eager",rank="1"'}
    bw = before["v100plan_decode_read_bw_gbps"]
    assert set(bw) == {'rank="0",source="measured"', 'rank="1",source="measured"'}
    assert all(v > 0.1 for v in bw.values())
    assert "v100plan_decode_ms_per_token" not in before and "v100plan_decode_achieved_gbps" not in before

    r = svc.complete(prompt_ids("The quick brown fox"), 40, ignore_eos=True)
    assert r.status_code == 200, r.text
    g = _gauges(svc.client.get("/metrics").text)
    for rank in ("0", "1"):
        ms = g["v100plan_decode_ms_per_token"][f'rank="{rank}"']
        gbps = g["v100plan_decode_achieved_gbps"][f'rank="{rank}"']
        frac = g["v100plan_decode_read_bw_fraction"][f'rank="{rank}"']
        read = bw[f'rank="{rank}",source="measured"']
        assert 0.01 < ms < 5000
        assert gbps > 0 and frac == pytest.approx(gbps / read, rel=0.02, abs=2e-4)
    assert "v100plan_decode_step_ms" not in g  # device step times exist only for CUDA graph replays

    body = svc.client.get("/health").json()
    dec = body["decode"]
    assert set(dec) == {"0", "1"}
    d0 = dec["0"]
    assert d0["mode"] == "eager" and d0["why"].startswith("CPU") and d0["kernels"] == "eager"
    assert d0["read_bw_source"] == "measured" and d0["steps"] >= 39
    assert d0["achieved_gbps"] == pytest.approx(d0["weight_bytes"] / (d0["token_ms"] * 1e-3) / 1e9, rel=0.01, abs=1e-3)
    assert d0["token_ms"] == g["v100plan_decode_ms_per_token"]['rank="0"']
    # Without the key, /health says only whether the service is up.
    import httpx
    assert httpx.get(svc.url + "/health", timeout=10).json() == {"status": "ok"}

    ev = wait_until(lambda: svc.events("decode_stats"), 10, what="a decode_stats log event")[-1]
    assert ev["ranks"]["0"]["token_ms"] > 0 and ev["ranks"]["0"]["mode"] == "eager"
    assert svc.events("decode")[-1]["ranks"]["1"]["read_bw_source"] == "measured"
    text = Path(svc.state_dir, "logs", f"rank0.g{body['generation']}.log").read_text()
    assert re.search(r"\[rank 0\] decode eager \(CPU: eager steps\); kernels eager .*; read bandwidth "
                     r"[\d.]+ GB/s \(measured\)", text), text[-2000:]
    assert re.search(r"\[rank 0\] decode eager/eager: step n/a \(device\), token [\d.]+ ms \(wall\), "
                     r"[\d.]+ GB/s = [\d.]+ % of [\d.]+ GB/s \(measured\), over \d+ steps", text), text[-2000:]


def test_read_bandwidth_from_the_environment_is_labelled_flag(monkeypatch):
    """A rank given the card's read bandwidth reports it as given, not as measured."""
    import argparse

    from engine.service import rank, rank_cli

    monkeypatch.setenv(rank_cli.READ_BW_ENV, "4326")
    p = argparse.ArgumentParser()
    rank_cli.add_args(p)
    args = p.parse_args(["--model", "m", "--rank", "0", "--world", "1", "--rendezvous", "x",
                         "--control-socket", "y"])
    assert args.read_bw_gbps == 4326.0
    r = rank.Rank(args)
    import torch
    assert r._read_bw(torch.device("cpu")) == {"read_bw_gbps": 4326.0, "read_bw_source": "flag"}
    monkeypatch.delenv(rank_cli.READ_BW_ENV)
    p = argparse.ArgumentParser()
    rank_cli.add_args(p)
    args = p.parse_args(["--model", "m", "--rank", "0", "--rendezvous", "x", "--control-socket", "y"])
    got = rank.Rank(args)._read_bw(torch.device("cpu"))
    assert got["read_bw_source"] == "measured" and got["read_bw_gbps"] > 0.1


class Link:
    """What DecodeReport reads of a rank's link: its rank and ready message."""

    def __init__(self, rank, ready):
        self.rank, self.ready = rank, ready


def test_report_replaces_a_pair_and_never_invents_figures(tmp_path):
    """A new pair clears the old pair's figures; a rank that has not reported has no gauge."""
    m = Metrics()
    log = StructuredLog(os.fspath(tmp_path / "log"))
    rep = DecodeReport(m, log)
    info = {"mode": "graphs", "why": "CUDA graphs", "kernels": "compiled", "kernels_why": "x",
            "read_bw_gbps": 4300.0, "read_bw_source": "flag"}
    rep.ranks_up([Link(0, {"decode": info}), Link(1, {})])
    text = m.render()
    assert 'v100plan_decode_read_bw_gbps{rank="0",source="flag"} 4300' in text
    assert 'rank="1"' not in text and "\nv100plan_decode_ms_per_token" not in text
    rep.after_request([{"_rank": 0, "decode": {**info, "token_ms": 3.8, "step_ms": 3.7, "achieved_gbps": 2200.0,
                                               "read_bw_fraction": 0.51}}, {"_rank": 1}])
    text = m.render()
    assert 'v100plan_decode_step_ms{rank="0"} 3.7' in text
    assert 'v100plan_decode_read_bw_fraction{rank="0"} 0.51' in text
    assert rep.health()["0"]["token_ms"] == 3.8
    rep.ranks_up([Link(0, {"decode": {**info, "mode": "eager", "read_bw_source": "measured"}})])
    text = m.render()
    assert "v100plan_decode_step_ms{" not in text and 'source="flag"' not in text
    assert 'v100plan_decode_mode{kernels="compiled",mode="eager",rank="0"} 1' in text
    log.close()


def test_health_speculation_shows_the_settings_and_the_acceptance_since_start(tmp_path):
    m = Metrics()
    log = StructuredLog(os.fspath(tmp_path / "log"))
    rep = DecodeReport(m, log)
    assert rep.speculation(0) == {"method": "off", "draft_tokens": None, "mode": None, "drafted_tokens": 0,
                                  "accepted_tokens": 0, "acceptance_rate": None}
    rep.ranks_up([Link(0, {"decode": {"mode": "graphs", "speculation": {"mode": "graphs", "draft_tokens": 3}}})])
    assert rep.speculation(3)["acceptance_rate"] is None  # nothing drafted yet: no rate, not zero
    for drafted, accepted in ((9, 7), (6, 2)):  # two requests' counts, as proxy_service adds them
        m.inc("v100plan_spec_draft_tokens_total", drafted)
        m.inc("v100plan_spec_accepted_tokens_total", accepted)
    rep.ranks_up([Link(0, {"decode": {"speculation": {"mode": "graphs"}}})])  # a restarted pair keeps the totals
    assert rep.speculation(3) == {"method": "mtp", "draft_tokens": 3, "mode": "graphs", "drafted_tokens": 15,
                                  "accepted_tokens": 9, "acceptance_rate": 0.6}
    log.close()
