"""The batch loop's graph shapes (engine/service/batch_graphs.py) on CPU: the row buckets and windows, and the
padded step itself (B rows run as the next bucket, the rows past B repeating row 0), here without graphs (the
same static buffers, run eagerly): each row answers what it answers alone, and a slot no row names is left bit
for bit as it was. Graph replays against the eager step: tests/engine/test_engine_batch_graphs_gpu.py."""

from __future__ import annotations

import pytest
import torch

from engine.service.batch_graphs import BatchGraphs, bucket, padded, row_buckets
from tests.engine.test_engine_slots import CHUNK, CONTEXT, PROMPTS, _close, _demo, _solo

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 10


def test_row_buckets_double_up_to_n_and_a_batch_takes_the_smallest_that_holds_it():
    assert row_buckets(1) == [1] and row_buckets(2) == [1, 2] and row_buckets(8) == [1, 2, 4, 8]
    assert row_buckets(6) == [1, 2, 4, 6] and row_buckets(64)[-2:] == [32, 64]
    assert [bucket(b, row_buckets(6)) for b in range(1, 8)] == [1, 2, 4, 4, 6, 6, None]
    assert padded([7, 8, 9], 4) == [7, 8, 9, 7] and padded([5], 1) == [5]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, one_thread):
    return _demo(tmp_path_factory, "qwen3_5")


def test_three_rows_padded_to_four_answer_alone_and_leave_the_other_slot_untouched(hybrid):
    m = hybrid
    want = [_solo(m, ids, STEPS) for ids in PROMPTS]
    m.setup_cache(CONTEXT, slots=4)
    order = [2, 0, 3]  # slot 1 holds a fourth sequence that does not decode in these steps
    with torch.inference_mode():
        m.prefill_slot(1, [1, 5, 9, 44, 100, 7], CHUNK)
        held = [t[1].clone() for la in m.layers for t in la.state()]
        logits = [m.prefill_slot(order[i], ids, CHUNK) for i, ids in enumerate(PROMPTS)]
        g = BatchGraphs(m, 4, [64, 128])  # no capture here: every shape runs eagerly through the same buffers
        assert g.rows == [1, 2, 4]
        toks, pos = [[] for _ in PROMPTS], [len(ids) for ids in PROMPTS]
        for _ in range(STEPS):
            for i, row in enumerate(logits):
                assert _close(row, want[i][1][len(toks[i])]) < 1e-5, f"sequence {i} step {len(toks[i])}"
                toks[i].append(int(row.argmax()))
            out = g.step([t[-1] for t in toks], pos, order, pos)
            assert out.shape == (3, m.cfg.vocab_size)
            logits = list(out)
            pos = [p + 1 for p in pos]
        assert g.eager_steps == STEPS and g.replays == 0
    for i in range(len(PROMPTS)):
        assert toks[i] == want[i][0], f"sequence {i}"
    after = [t[1] for la in m.layers for t in la.state()]
    assert all(torch.equal(a, b) for a, b in zip(held, after)), "the padded row wrote into a slot no row named"


def test_a_position_past_the_last_window_and_too_many_rows_are_refused(hybrid):
    m = hybrid
    m.setup_cache(CONTEXT, slots=2)
    g = BatchGraphs(m, 2, [64, 128])
    with pytest.raises(ValueError, match="past the context limit 128"):
        g.step([1], [128], [0], [128])
    with pytest.raises(ValueError, match="at most 2 sequences"):
        g.step([1, 2, 3], [4, 4, 4], [0, 1, 0], [4, 4, 4])


def test_serve_batch_graphs_are_on_by_default_the_opt_out_reaches_the_ranks_and_each_rank_says_why_it_runs_eagerly(hybrid, tmp_path):
    import argparse

    from engine.core import demo, runner
    from engine.service import batch_graphs
    from engine.service import serve_config as sc
    from engine.service.rank_cli import add_args

    rp = argparse.ArgumentParser()
    add_args(rp)

    demo.make(tmp_path, arch="llama")
    p = argparse.ArgumentParser()
    sc.add_serve_arguments(p)
    on = sc.config_from_args(p.parse_args(["--model", str(tmp_path), "--max-concurrency", "4"]))
    off = sc.config_from_args(p.parse_args(["--model", str(tmp_path), "--max-concurrency", "4", "--no-batch-graphs"]))
    assert on.batch_graphs and not off.batch_graphs
    assert "--no-batch-graphs" not in sc.rank_command(on, 0, 1, "/tmp/rv", "/tmp/sock")
    assert rp.parse_args(sc.rank_command(on, 0, 1, "/tmp/rv", "/tmp/sock")[4:]).batch_graphs  # after -m engine rank
    assert not rp.parse_args(sc.rank_command(off, 0, 1, "/tmp/rv", "/tmp/sock")[4:]).batch_graphs

    m = hybrid
    m.setup_cache(CONTEXT, slots=4)
    dec = runner.prepare(m)  # on CPU: no graphs
    assert batch_graphs.for_rank(m, dec, 1, enabled=True)[1]["mode"] == "none"
    g, info = batch_graphs.for_rank(m, dec, 4, enabled=False)
    assert g is None and info["mode"] == "eager" and "--no-batch-graphs" in info["why"]
    g, info = batch_graphs.for_rank(m, dec, 4)  # the default: on, where the decoder runs graphs
    assert g is None and info["mode"] == "eager" and "runs no graphs here" in info["why"]
