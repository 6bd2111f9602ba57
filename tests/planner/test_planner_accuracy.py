"""The planner against published batch-1 decode figures (profiles/published/decode-batch1.json).

Not timed: these plan each published configuration and judge the prediction. Calibration points
must reproduce (their engine profile's arithmetic says how they set it); held-out points are the
prediction test. Takes about 2 s.
"""

from __future__ import annotations

import json

import pytest

from tests.paths import REPO
from v100plan import plan_accuracy as accuracy

# Held-out points the planner misses by more than the goal's 15 %, each with the reason (reported, not hidden;
# docs/planner-accuracy.md, "What the misses say").
KNOWN_MISSES: dict[str, str] = {
    "ninfer-replicas-131k": "unexplained: 42 tok/s needs a round 11 ms above the tuned engine's calibrated line",
    "exl2-4090-tinyllama-3.0": "a 1.1 B model at 730 tok/s: a fixed host-side cost per token that two calibration "
                               "points of 32 and 80 layers cannot separate from the per-layer cost",
    "exl2-4090-tinyllama-4.0": "the same host-side cost per token as the 3.0-bit row",
}


@pytest.fixture(scope="module")
def rows():
    return accuracy.evaluate(REPO)


def test_the_data_file_has_twenty_sourced_points_split_before_fitting():
    doc = accuracy.load_points()
    points = doc["points"]
    assert len(points) >= 20
    assert {p["role"] for p in points} == {"calibration", "held_out"}
    for p in points:
        src = doc["sources"][p["source"]]
        assert src["url"] and src["build"] and src["settings"] and p["figure"], p["id"]
    assert len({p["id"] for p in points}) == len(points)


def test_every_published_figure_is_under_the_ceiling(rows):
    for r in rows:
        assert r.ceiling_tok_s is not None and r.published_tok_s <= r.ceiling_tok_s, r.id


def test_calibration_points_reproduce(rows):
    for r in rows:
        if r.role == "calibration":
            assert abs(r.error) < 0.02, (r.id, r.error)


def test_held_out_accuracy(rows):
    """The goal: held-out median within 5 %, none beyond 15 % except the named misses, and a named miss that is
    no longer one must leave the list (the reasons in docs/planner-accuracy.md stay true)."""
    s = accuracy.summary(rows)
    assert s["held_out_predicted"] == s["held_out"] >= 10
    assert s["held_out_median_abs_error"] <= accuracy.GOAL_MEDIAN == 0.05
    for r in rows:
        if r.role == "held_out" and r.id not in KNOWN_MISSES:
            assert abs(r.error) <= accuracy.GOAL_WORST == 0.15, (r.id, r.error)
        if r.id in KNOWN_MISSES:
            assert r.role == "held_out" and abs(r.error) > accuracy.GOAL_WORST, (r.id, r.error)


def test_wide_tensor_parallel_points_pay_for_their_allreduces(rows):
    """Every gpt-fast tp4/tp8 point is priced from the A100 box's 4- or 8-GPU figure, not left unpriced."""
    wide = [r for r in rows if r.engine == "gpt-fast" and r.strategy in ("tp4", "tp8")]
    assert len(wide) == 6
    for r in wide:
        n = r.strategy[2:]
        assert any(note.startswith(f"tp{n}: each allreduce priced from a100-80gb's {n}-GPU figure") for note in r.notes), r.id


def test_engine_profiles_name_the_points_they_were_calibrated_on():
    """A calibration point's figure appears in its engine profile's calibration list; no held-out figure does."""
    from v100plan import catalogue

    for p in accuracy.load_points()["points"]:
        cal = json.dumps(catalogue.get("engine", p["engine"]).get("calibration", []))
        number = f"{p['decode_tok_s']:g}"
        if p["role"] == "held_out" and p["engine"] in ("llamacpp", "vllm"):
            assert f" {number} " not in cal.replace(",", " ").replace(";", " "), p["id"]


def test_bench_planner_command(cli):
    r = cli("bench", "planner", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["summary"]["points"] >= 20 and not doc["summary"]["over_ceiling"]
    assert all(row["source"] for row in doc["rows"])


def test_bench_planner_prints_the_table_at_either_end_of_a_ranged_figure(cli):
    """--allreduce-range moves only the points priced on a ranged path (gpt-fast's tensor parallel rows)."""
    docs = {}
    for end in ("low", "high"):
        r = cli("bench", "planner", "--json", "--allreduce-range", end)
        assert r.exit_code == 0, r.stderr
        docs[end] = json.loads(r.stdout)
        assert docs[end]["summary"]["allreduce_range"] == end
    rows = {end: {row["id"]: row for row in doc["rows"]} for end, doc in docs.items()}
    for pid, low in rows["low"].items():
        high = rows["high"][pid]
        if low["engine"] == "gpt-fast" and low["gpus"] > 1:
            assert low["predicted_tok_s"] > high["predicted_tok_s"], pid
        else:
            assert low["predicted_tok_s"] == high["predicted_tok_s"], pid
    bad = cli("bench", "planner", "--allreduce-range", "middle")
    assert bad.exit_code == 2 and "low, high" in bad.stderr


def test_the_documented_table_is_the_one_the_planner_prints(rows):
    """docs/planner-accuracy.md's table ("## The table") lists every point with the prediction and error that
    `v100plan bench planner` gives now: a profile change that moves a row must move the page with it."""
    text = (REPO / "docs" / "planner-accuracy.md").read_text()
    section = text.split("## The table", 1)[1].split("\n## ", 1)[0]
    documented = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 11 and cells[1] in ("calibration", "held_out"):
            documented[cells[0]] = cells
    assert set(documented) == {r.id for r in rows}
    for r in rows:
        cells = documented[r.id]
        assert cells[1] == r.role, r.id
        assert float(cells[7]) == pytest.approx(r.published_tok_s, abs=0.005), r.id
        assert cells[8] == f"{r.predicted_tok_s:.2f}", r.id
        assert cells[10] == f"{r.error:+.1%}", r.id
    s = accuracy.summary(rows)
    assert (f"median |error| {s['held_out_median_abs_error']:.1%}, worst {s['held_out_worst_abs_error']:.1%}"
            in section)
