"""GPTQ and AWQ 4-bit checkpoints (engine/core/quant.py, quant_load.py): made here from random transformers models
(tests/quant_helpers.py), loaded packed, and judged against transformers holding the same weights dequantised, at
TP1 in this process and at TP2 through `python -m engine generate --tp 2` and `python -m engine shard`."""

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
from tests.quant_helpers import greedy, make_quantised
from tests.quant_helpers import held_bytes as _held_bytes

PROMPT = [1, 17, 300, 42, 5, 99]

CASES = {  # name -> (architecture, method, group size, sym, desc_act, modules left dense)
    "gptq-sym-g32": ("llama-3.1-8b", "gptq", 32, True, False, ()),
    "gptq-asym-g64-dense-o": ("llama-3.1-8b", "gptq", 64, False, False, ("o_proj",)),
    "gptq-sym-g128-desc-act": ("llama-3.1-8b", "gptq", 128, True, True, ()),
    "gptq-asym-g128-qwen2-bias": ("qwen2.5-0.5b", "gptq", 128, False, False, ()),
    "awq-g64": ("llama-3.1-8b", "awq", 64, False, False, ()),
    "awq-g128-qwen3": ("qwen3-8b", "awq", 128, False, False, ("down_proj",)),
}


def _reference(hf, n: int) -> list[int]:
    return greedy(hf, PROMPT, n)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for key, (arch, method, group, sym, desc, dense) in CASES.items():
        d = tmp_path_factory.mktemp(key)
        hf, tensors = make_quantised(arch, d, method, group, sym, desc, dense)
        made[key] = (d, hf, tensors)
    return made


@pytest.mark.parametrize("key", sorted(CASES))
def test_packed_checkpoint_gives_transformers_tokens_on_the_dequantised_weights(checkpoints, key):
    d, hf, tensors = checkpoints[key]
    model = Model(ecfg.load(d))
    weights.load_into(model, d)
    model.setup_cache(128)
    packed = model.packed()
    dense = CASES[key][5]
    assert len(packed) == len(model.layers) * (4 - len(dense))  # kept packed: int32 words, no dequantised copy
    assert all(p.qweight.dtype == torch.int32 and p.qweight.shape[1] * 8 == p.in_features for p in packed)
    out, reason = runner.run(model, PROMPT, 16, Sampler(), set(), chunk=4)
    assert out == _reference(hf, 16)
    info = model.weights_info()
    assert info["format"].startswith(f"{CASES[key][1]}-int4-g{CASES[key][2]}")
    assert info["bytes"] == _held_bytes(tensors, CASES[key][4])


def test_reference_dequantise_is_the_weight_transformers_holds(checkpoints):
    for key in ("gptq-sym-g128-desc-act", "awq-g64"):
        d, hf, _ = checkpoints[key]
        model = Model(ecfg.load(d))
        weights.load_into(model, d)
        layer = model.layers[1]
        ref = hf.model.layers[1]
        qkv = torch.cat([ref.self_attn.q_proj.weight, ref.self_attn.k_proj.weight, ref.self_attn.v_proj.weight])
        assert torch.equal(layer.wqkv.dequantise(), qkv)
        assert torch.equal(layer.mlp.w2.dequantise(), ref.mlp.down_proj.weight)


def _generate(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "generate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("key,sharded", [("gptq-asym-g128-qwen2-bias", False), ("awq-g128-qwen3", True)])
def test_tp2_splits_packed_weights_and_gives_the_same_tokens(checkpoints, key, sharded, tmp_path):
    """Each rank slices the packed file at load (column-parallel in whole words, row-parallel at group
    boundaries), or reads its part written by the shard tool, which reassembles bit-exactly."""
    d, hf, tensors = checkpoints[key]
    if sharded:
        res = subprocess.run([sys.executable, "-m", "engine", "shard", str(d), str(tmp_path / "tp2"), "--tp", "2",
                              "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        manifest = json.loads(res.stdout)
        assert manifest["verified"] == "reassembled bit-exactly"
        assert manifest["tensors"]["model.layers.0.self_attn.o_proj.qweight"] == "rowwise"
        assert manifest["tensors"]["model.layers.0.mlp.gate_proj.qzeros"] == "colwise"
        assert sum(manifest["bytes_per_rank"]) >= _held_bytes(tensors, False)  # replicated tensors twice
        d = tmp_path / "tp2"
    res = _generate(["--model", str(d), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "12", "--tp",
                     "2", "--json"])
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["token_ids"] == _reference(hf, 12)
    assert got["weights"]["format"].startswith(CASES[key][1])
    # a rank holds its half of every split tensor, the replicated ones whole
    assert got["weights"]["bytes"] < _held_bytes(tensors, False)


def test_generate_json_reports_the_format_and_the_packed_bytes(checkpoints):
    d, _, tensors = checkpoints["gptq-sym-g32"]
    res = _generate(["--model", str(d), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--json"])
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["weights"] == {"format": "gptq-int4-g32 (float32 dense)", "bytes": _held_bytes(tensors, False),
                              "packed_matrices": 8}


def test_a_row_parallel_split_that_cuts_a_group_is_refused(tmp_path):
    d = tmp_path / "cut"
    make_quantised("llama-3.1-8b", d, "gptq", 128, override={"intermediate_size": 384})  # down: 192 inputs a rank
    with pytest.raises(quant.QuantError, match="down_proj's 384 inputs over 2 ranks .192 each. would cut groups of 128"):
        weights.load_into(Model(ecfg.load(d), world=2, rank=0), d)
    res = subprocess.run([sys.executable, "-m", "engine", "shard", str(d), str(tmp_path / "out"), "--tp", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "would cut groups of 128" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("change,named", [
    ({"bits": 3}, "quantization_config.bits = 3"),
    ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method 'bitsandbytes'"),
    ({"group_size": 48}, "quantization_config.group_size = 48"),
    ({"group_size": 128}, "group_size 128 does not divide o_proj's 192 inputs"),  # Qwen3 shrunk: 4 heads x 48
    ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format 'marlin'"),
])
def test_a_bad_quantization_config_exits_2_naming_the_field(tmp_path, change, named):
    from tests.engine_helpers import small_config

    raw = small_config("qwen3-8b")
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
    raw["quantization_config"] = {**qc, **change}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    res = _generate(["--model", str(tmp_path), "--prompt-ids", "1,2", "--max-tokens", "1"])
    assert res.returncode == 2, res.stderr
    assert named in res.stderr and "Traceback" not in res.stderr


def test_nibble_packing_round_trips_and_awq_order_is_autoawq_s():
    g = torch.Generator().manual_seed(0)
    v = torch.randint(0, 16, (3, 64), generator=g)
    from engine.kernels import int4_pack

    assert torch.equal(int4_pack.unpack(int4_pack.pack(v)).long(), v)
    word = sum(c << (4 * i) for i, c in enumerate(int4_pack.AWQ_ORDER))  # nibble i holds column AWQ_ORDER[i]
    assert int4_pack.awq_to_natural(torch.tensor([[word]], dtype=torch.int32)).tolist() == [list(range(8))]
