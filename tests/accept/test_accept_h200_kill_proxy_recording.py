"""kill_proxy on one H200 (nvidia-h200, 2026-12-02): the hybrid MTP demo as TP2 with both ranks on the one card
(cuda:0,cuda:0, float32, --speculative mtp) under its supervisor at serve's defaults, `v100plan accept --supervised
--only kill_proxy --repeats 3`. Recorded (tests/fixtures/acceptance/kill-proxy-h200-2026-12-02/): the suite's
repetitions (accept.txt: recover time and event marks, seconds from the injection), the service log's events and
supervisord's log. Judged by what they measured: the suite's own times and the phases in the two logs."""

from __future__ import annotations

import ast
import json
import statistics
from datetime import datetime, timezone

import pytest

from tests.paths import FIXTURES

DIR = FIXTURES / "acceptance" / "kill-proxy-h200-2026-12-02"


@pytest.fixture(scope="module")
def reps() -> list[tuple[float, list]]:
    out = []
    for line in (DIR / "accept.txt").read_text().splitlines():
        key, recover, marks = line.split(" ", 2)
        assert key == "kill_proxy"
        out.append((float(recover), ast.literal_eval(marks)))
    return out


@pytest.fixture(scope="module")
def events() -> list[dict]:
    return [json.loads(line) for line in (DIR / "service.log").read_text().splitlines() if line.startswith("{")]


def _supervisord() -> list[tuple[float, str]]:
    out = []
    for line in (DIR / "supervisord.log").read_text().splitlines():
        stamp, rest = line[:23], line[24:]
        t = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=timezone.utc).timestamp()
        out.append((t, rest))
    return out


def test_each_killed_proxy_was_replaced_and_answered_exactly_within_5_s_median(reps):
    assert len(reps) == 3
    for i, (recover, marks) in enumerate(reps):
        labels = dict((label, t) for t, label in marks)
        assert labels["first exact answer"] == pytest.approx(recover, abs=0.01)
        assert labels[f"/health 200 (generation {i + 2})"] < recover  # a new rank generation each time
        assert labels["the request's connection was cut"] < 0.5  # the in-flight stream ends with the proxy
    assert statistics.median(r for r, _ in reps) <= 5.0


def test_the_phases_are_supervisord_s_tick_the_proxy_without_torch_and_a_rank_start_that_reuses(events):
    sup = _supervisord()
    exits = [t for t, s in sup if s.startswith("WARN exited: engine (terminated by SIGKILL")]
    spawns = [t for t, s in sup if s.startswith("INFO spawned: 'engine'")]
    assert len(exits) == 3 and len(spawns) == 4  # the first start and one per kill
    starts = [e for e in events if e["event"] == "serve_start"]
    forks = [e for e in events if e["event"] == "rank_forks_started"]
    ups = [e for e in events if e["event"] == "ranks_up"]
    assert len(starts) == len(forks) == len(ups) == 4
    assert not forks[0]["adopted"] and all(f["adopted"] and f["pid"] == forks[0]["pid"] for f in forks[1:])
    for k, killed in enumerate(exits):
        spawned = spawns[k + 1]
        start, up = starts[k + 1]["ts"], ups[k + 1]
        assert 0 < spawned - killed <= 1.2  # supervisord's next tick
        assert 0 < start - spawned <= 2.0  # the new proxy's imports: no torch (5 s of it before, on this host)
        assert 0 < up["ts"] - start <= 2.0 and up["start_s"] <= 2.0  # the adopted fork server's new pair
        assert up["race"] == ups[0]["race"] and up["allreduce"] == ups[0]["allreduce"]  # taken over, not raced
