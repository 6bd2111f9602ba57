"""A GPTQ checkpoint of the hybrid with its MTP draft layer packed too (mtp.layers.N.*.qweight, as 4-bit releases
of Qwen3.5 carry it): the draft layer's matrices are held packed (no dense copy), its weight bytes are counted, and
speculation over it drafts exactly what the same model with the dequantised weights drafts, so greedy answers and
accepted counts equal that dense model's (and one-token decoding's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.core import config as ecfg
from engine.core import quant, runner, weights
from engine.core.model import Model
from engine.core.sampling import Sampler
from tests.engine_helpers import REPO
from tests.quant_helpers import pack_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py

PROMPTS = [[1, 17, 200, 42, 5, 99, 7, 150, 3, 3, 3, 3], list(range(40, 70))]
GROUP = 32


@pytest.fixture(scope="module")
def checkpoints(mtp_demo_dir, tmp_path_factory):
    """(packed: GPTQ v1 sym g32, every projection of the decoder and of the draft layer; dense: the same weights
    dequantised, as a plain checkpoint; the packed file's tensors)."""
    packed, dense = tmp_path_factory.mktemp("mtp-packed"), tmp_path_factory.mktemp("mtp-dense")
    return packed, dense, pack_checkpoint(mtp_demo_dir, packed, dense, GROUP)


def _load(d) -> Model:
    m = Model(ecfg.load(d))
    weights.load_into(m, d)
    m.setup_cache(256)
    runner.prepare(m)
    return m


def test_the_draft_layer_is_held_packed_and_counted(checkpoints):
    packed_dir, _, tensors = checkpoints
    m = _load(packed_dir)
    assert m.mtp is not None and len(m.mtp.layers) == 1
    layer = m.mtp.layers[0]
    for attr in ("wqkv", "wo", "w13", "w2"):
        w = getattr(layer.owner(attr), attr)
        assert isinstance(w, quant.PackedLinear) and w.qweight.dtype == torch.int32, attr
    assert len(m.packed()) == 4 * (len(m.layers) + 1)  # the decoder's four matrices a layer, and the draft layer's
    held = sum(t.numel() * t.element_size() for name, t in tensors.items() if not name.endswith("g_idx"))
    if "lm_head.weight" not in tensors:
        held += tensors["model.embed_tokens.weight"].numel() * tensors["model.embed_tokens.weight"].element_size()
    assert m.weights_info()["bytes"] == held  # every tensor of the file, the draft layer's included


@pytest.mark.parametrize("k", [1, 3])
def test_speculation_over_the_packed_draft_layer_drafts_what_the_dequantised_one_drafts(checkpoints, k):
    packed_dir, dense_dir, _ = checkpoints
    pm, dm = _load(packed_dir), _load(dense_dir)
    for prompt in PROMPTS:
        plain, _ = runner.run(pm, prompt, 24, Sampler(), set(), 16)
        got, want = {}, {}
        out_p, _ = runner.run(pm, prompt, 24, Sampler(), set(), 16, info=got, spec_tokens=k)
        out_d, _ = runner.run(dm, prompt, 24, Sampler(), set(), 16, info=want, spec_tokens=k)
        assert out_p == plain == out_d
        assert got["spec"] == want["spec"] and got["spec"]["draft_tokens"] > 0


def test_tp2_speculative_generate_over_the_packed_checkpoint_equals_tp1(checkpoints):
    """Each rank slices the packed draft layer as it slices the decoder's (outputs in whole words, inputs at group
    boundaries): `generate --tp 2 --speculative mtp` gives TP1's tokens and counts, and one-token decoding's."""
    packed_dir, _, _ = checkpoints
    outs = []
    for tp, spec in (("1", True), ("2", True), ("1", False)):
        extra = ["--speculative", "mtp", "--draft-tokens", "3"] if spec else []
        proc = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(packed_dir), "--tp", tp,
                               "--prompt-ids", ",".join(map(str, PROMPTS[1])), "--max-tokens", "24", *extra,
                               "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert outs[0]["token_ids"] == outs[1]["token_ids"] == outs[2]["token_ids"]
    assert outs[0]["spec"] == outs[1]["spec"] and outs[0]["spec"]["draft_tokens"] > 0
    assert outs[1]["weights"]["format"].startswith("gptq-int4-g32")
    assert outs[1]["weights"]["bytes"] < outs[0]["weights"]["bytes"]  # rank 0's half of the split tensors
