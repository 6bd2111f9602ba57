"""GPTQ and AWQ checkpoints of the hybrid class (Qwen3.5) with the Gated DeltaNet projections packed (in_proj_qkv,
in_proj_z, out_proj; the small in_proj_b / in_proj_a dense, as such checkpoints leave them), besides packed MLPs and
gated attention: loaded packed and judged against transformers' Qwen3_5ForCausalLM holding the same weights
dequantised, at TP1 in this process and at TP2 through `python -m engine generate --tp 2` and `python -m engine
shard`."""

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
from tests.engine.test_engine_hybrid import SMALL
from tests.engine_helpers import REPO
from tests.quant_helpers import QUANTISED, greedy, held_bytes, quantise_model, write_checkpoint

GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
PROMPT = [1, 17, 300, 42, 5, 99, 7, 250]

CASES = {  # name -> (method, group size, sym, modules left dense, config override)
    "gptq-sym-g32": ("gptq", 32, True, ("in_proj_b", "in_proj_a"), {}),
    "gptq-asym-g64": ("gptq", 64, False, ("in_proj_b", "in_proj_a"), {}),
    "awq-g32": ("awq", 32, False, ("in_proj_b", "in_proj_a"), {}),
    # eight value heads: b and a have whole words of outputs, so all four in_proj modules are one packed matrix
    "awq-g64-all-packed": ("awq", 64, False, (), {"linear_num_value_heads": 8}),
}


def make_hybrid(out, method: str, group: int, sym: bool, dense: tuple[str, ...], override: dict):
    import transformers

    raw = {**SMALL, **override}
    text = transformers.Qwen3_5TextConfig(**raw)
    torch.manual_seed(4321)
    model = transformers.Qwen3_5ForCausalLM(text).eval()
    tensors = quantise_model(model, method, group, sym, False, QUANTISED + GDN, dense, seed=4321)
    write_checkpoint(out, model, tensors, text.to_dict(), method, group, sym, False)
    return model, tensors


def _reference(hf, n: int) -> list[int]:
    return greedy(hf, PROMPT, n)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for key, (method, group, sym, dense, override) in CASES.items():
        d = tmp_path_factory.mktemp(key)
        hf, tensors = make_hybrid(d, method, group, sym, dense, override)
        made[key] = (d, hf, tensors, _reference(hf, 16))
    return made


@pytest.mark.parametrize("key", sorted(CASES))
def test_packed_gdn_checkpoint_gives_transformers_tokens_on_the_dequantised_weights(checkpoints, key):
    d, hf, tensors, ref = checkpoints[key]
    model = Model(ecfg.load(d))
    weights.load_into(model, d)
    model.setup_cache(128)
    lin = [la for la in model.layers if la.kind == "linear_attention"]
    assert all(isinstance(la.w_out, quant.PackedLinear) for la in lin)
    if CASES[key][3]:  # b / a dense: [in_proj_qkv | z] one packed matrix, [b | a] one dense one
        assert all(isinstance(la.w_in, quant.Rows) for la in lin)
        parts = lin[0].w_in.parts
        assert [type(p) for p in parts] == [quant.PackedLinear, torch.Tensor]
        assert parts[0].out_features == lin[0].conv_channels + lin[0].nv * lin[0].dv
    else:
        assert all(isinstance(la.w_in, quant.PackedLinear) for la in lin)
    assert len(model.packed()) == 4 * len(model.layers)  # wqkv/wo or w_in/w_out, w13, w2: no dequantised copy
    ref_layer = hf.model.layers[0].linear_attn
    want = torch.cat([ref_layer.in_proj_qkv.weight, ref_layer.in_proj_z.weight, ref_layer.in_proj_b.weight,
                      ref_layer.in_proj_a.weight])
    assert torch.equal(lin[0].w_in.dequantise(), want)
    assert torch.equal(lin[0].w_out.dequantise(), ref_layer.out_proj.weight)
    out, reason = runner.run(model, PROMPT, 16, Sampler(), set(), chunk=4)  # prefill chunks, then decode steps
    assert out == ref
    info = model.weights_info()
    assert info["format"].startswith(f"{CASES[key][0]}-int4-g{CASES[key][1]}")
    assert info["bytes"] == held_bytes(tensors, False)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("key,sharded", [("gptq-sym-g32", False), ("awq-g32", True)])
def test_tp2_splits_packed_gdn_projections_by_heads_and_gives_the_same_tokens(checkpoints, key, sharded, tmp_path):
    """in_proj_qkv split by heads in whole packed words ([q_r | k_r | v_r] of the outputs), out_proj row-parallel
    at group boundaries: sliced at load, or by the shard tool, which reassembles every tensor bit-exactly."""
    d, hf, tensors, ref = checkpoints[key]
    if sharded:
        res = _run(["shard", str(d), str(tmp_path / "tp2"), "--tp", "2", "--json"])
        assert res.returncode == 0, res.stderr[-2000:]
        manifest = json.loads(res.stdout)
        assert manifest["verified"] == "reassembled bit-exactly"
        kinds = manifest["tensors"]
        assert kinds["model.layers.0.linear_attn.in_proj_qkv.qweight"] == "colwise_qkv"
        assert kinds["model.layers.0.linear_attn.in_proj_qkv.qzeros"] == "colwise_qkv"
        assert kinds["model.layers.0.linear_attn.out_proj.scales"] == "rowwise"
        assert kinds["model.layers.0.linear_attn.in_proj_z.qweight"] == "colwise"
        d = tmp_path / "tp2"
    res = _run(["generate", "--model", str(d), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "16",
                "--tp", "2", "--json"])
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["token_ids"] == ref
    assert got["weights"]["format"].startswith(CASES[key][0])
    assert got["weights"]["bytes"] < held_bytes(tensors, False)  # its half of every split tensor


def test_rank_parts_of_a_packed_in_proj_qkv_are_its_heads_rows(checkpoints):
    """Rank r's packed in_proj_qkv dequantises to rows [q_r | k_r | v_r] of the whole matrix."""
    d, _, _, _ = checkpoints["awq-g32"]
    whole = Model(ecfg.load(d))
    weights.load_into(whole, d)
    full = whole.layers[0].w_in.parts[0].dequantise()[:whole.layers[0].conv_channels]
    kd, vd = whole.cfg.linear_key_dim, whole.cfg.linear_value_dim
    q, k, v = full.split([kd, kd, vd])
    for rank in (0, 1):
        m = Model(ecfg.load(d), world=2, rank=rank)
        weights.load_into(m, d)
        mine = m.layers[0].w_in.parts[0].dequantise()[:m.layers[0].conv_channels]
        want = torch.cat([t.chunk(2)[rank] for t in (q, k, v)])
        assert torch.equal(mine, want)


def test_an_out_proj_split_that_cuts_a_group_is_refused(checkpoints, tmp_path):
    d, _, _, _ = checkpoints["gptq-asym-g64"]  # out_proj: 192 inputs, 96 a rank, groups of 64
    with pytest.raises(quant.QuantError, match="out_proj's 192 inputs over 2 ranks .96 each. would cut groups of 64"):
        weights.load_into(Model(ecfg.load(d), world=2, rank=0), d)
    res = _run(["shard", str(d), str(tmp_path / "out"), "--tp", "2"])
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "out_proj's 192 inputs over 2 ranks (96 each) would cut groups of 64" in res.stderr
