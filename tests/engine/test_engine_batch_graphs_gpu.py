"""The batch loop's captured step on the GPU (engine/service/batch_graphs.py; run on the lent device, skipped
without CUDA): three sequences padded to the 4-row bucket, replayed from graphs, give bit for bit the logits and
leave bit for bit the states that the same padded step run eagerly gives and leaves; a slot no row names is not
touched; the graphs are what ran (no eager fallback)."""

from __future__ import annotations

import pytest

from engine.core import config as ecfg
from engine.core import demo, weights
from tests.engine.test_engine_graphs_gpu import needs_gpu

pytestmark = pytest.mark.gpu
PROMPTS = [[1, 49, 78, 148, 183], [1] + [(13 * i + 5) % 250 + 3 for i in range(22)],
           [1] + [(29 * i + 11) % 250 + 3 for i in range(119)]]  # 120: its steps cross window 128
HELD = [1, 5, 9, 44, 100, 7]
ORDER = [2, 0, 3]
STEPS = 12


def _states(m):
    return [t.clone() for la in m.layers for t in la.state()]


@needs_gpu
@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
def test_graph_replays_equal_the_padded_eager_step_bit_for_bit(tmp_path, arch):
    import torch

    from engine.core.model import Model
    from engine.service.batch_graphs import BatchGraphs

    demo.make(tmp_path, arch=arch)
    m = Model(ecfg.load(tmp_path), dtype=torch.bfloat16, device="cuda:0")
    weights.load_into(m, tmp_path)
    m.setup_cache(256, slots=4)
    graphed = BatchGraphs(m, 4, [128, 256])
    info = graphed.capture()
    assert info["graphs"] == 6 and not info["eager_shapes"], info
    eager = BatchGraphs(m, 4, [128, 256])  # not captured: the same buffers and padding, launched eagerly

    with torch.inference_mode():
        m.prefill_slot(1, HELD, 32)
        firsts = [int(m.prefill_slot(ORDER[i], ids, 32).argmax()) for i, ids in enumerate(PROMPTS)]
    start = _states(m)
    runs = {}
    for name, g in (("graphs", graphed), ("eager", eager)):
        for t, s in zip([t for la in m.layers for t in la.state()], start):
            t.copy_(s)
        toks, pos, rows = [[f] for f in firsts], [len(ids) for ids in PROMPTS], []
        for _ in range(STEPS):  # positions cross the 128 window: two graphs of the 4-row bucket run
            out = g.step([t[-1] for t in toks], pos, ORDER, pos)
            rows.append(out)
            for i, row in enumerate(out):
                toks[i].append(int(row.argmax()))
            pos = [p + 1 for p in pos]
        torch.cuda.synchronize()
        runs[name] = (toks, rows, _states(m))
    assert graphed.replays == STEPS and graphed.eager_steps == 0
    assert eager.eager_steps == STEPS
    (gt, gr, gs), (et, er, es) = runs["graphs"], runs["eager"]
    assert gt == et
    assert all(torch.equal(a, b) for a, b in zip(gr, er)), "graph logits differ from the eager step's"
    assert all(torch.equal(a, b) for a, b in zip(gs, es)), "graph states differ from the eager step's"
    held = [s[1] for s in start]
    assert all(torch.equal(a[1], b) for a, b in zip(gs, held)), "the padded row touched slot 1"
