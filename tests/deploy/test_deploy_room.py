"""The blue/green decision's arithmetic (v100plan/remote/room.py), without a host: nvidia-smi's csv, the
need per rank from the planner's own formulas, and the choice with its numbers. The host-side behaviour
(a fake nvidia-smi on a real sshd) is tests/deploy/test_deploy_gpu_switch.py."""

from __future__ import annotations

import json

import pytest

from v100plan.errors import BadInput
from v100plan.remote import release as rel
from v100plan.remote import room

# An H200 pair as `nvidia-smi --query-gpu=index,memory.used,memory.total,memory.free --format=csv,noheader,
# nounits` prints it: 143771 MiB total (tests/fixtures/acceptance/qualify-h200x2-bf16-2026-11-30.txt); card 1
# at the 139743 MiB used while the 27B served 256K (tests/fixtures/engine/h200-long-context-27b-256k-2026-12-02.json)
H200_PAIR = "0, 0, 143771, 143771\n1, 139743, 143771, 4028\n"
GPU = rel.EngineSettings(device="cuda", max_concurrency=1)  # deploy's GPU default: one at a time (a plan's)


def _llama_cfg() -> dict:
    return {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}


def test_nvidia_smi_csv_parses_in_bytes_and_a_strange_line_is_an_error():
    cards = room.parse_cards(H200_PAIR)
    assert [c.index for c in cards] == [0, 1]
    assert cards[1].free_bytes == 4028 << 20 and cards[1].used_bytes == 139743 << 20
    with pytest.raises(ValueError, match="unexpected nvidia-smi line"):
        room.parse_cards("0, [N/A], 143771, 143771\n")


def test_need_per_rank_is_the_shards_plus_the_planners_kv_plus_the_margin():
    from v100plan.planner.from_config import model_doc
    from v100plan.planner.inputs import model_from_doc

    cfg = _llama_cfg()
    need = room.rank_need_bytes(cfg, rel.EngineSettings(device="cuda", max_context=4096), [7_000_000_000] * 2)
    # K/V per token of the whole model: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 131072 B; half per rank
    assert model_from_doc(model_doc(cfg, "config.json")).kv_bytes_per_token == 131072
    assert need == [7_000_000_000 + 4096 * 131072 // 2 + room.MARGIN_BYTES] * 2
    native = room.rank_need_bytes(cfg, GPU, [7_000_000_000] * 2)[0]  # no --max-context: the model's 8192
    assert native - need[0] == 4096 * 131072 // 2
    from_config = room.rank_need_bytes(cfg, GPU, None)[0]  # no shard manifest: the planner's tp2 layout
    assert 6.0e9 < from_config - native + 7_000_000_000 < 8.0e9


def test_blue_green_only_when_every_card_holds_a_rank_and_asking_for_it_otherwise_is_refused():
    cards = room.parse_cards(H200_PAIR)
    sw = room.choose("auto", GPU, cards, "nvidia-smi", [3 << 30, 3 << 30], "r1", "box")
    assert sw.mode == "blue-green" and all(g["fits"] for g in sw.gpus)
    sw = room.choose("auto", GPU, cards, "nvidia-smi", [5 << 30, 5 << 30], "r1", "box")
    assert sw.mode == "stop-start" and [g["fits"] for g in sw.gpus] == [True, False]
    assert "GPU 1: needs 5.00 GiB, 3.93 GiB free of 140.40 GiB" in sw.why and "an outage" in sw.why
    with pytest.raises(BadInput, match="does not fit beside release r1 .GPU 1: needs 5.00 GiB"):
        room.choose("blue-green", GPU, cards, "nvidia-smi", [5 << 30, 5 << 30], "r1", "box")
    assert room.choose("stop-start", GPU, cards, "", [1, 1], "r1", "box").mode == "stop-start"
    one = room.parse_cards("0, 0, 143771, 143771\n")  # one card: both ranks on it
    assert room.choose("auto", GPU, one, "", [80 << 30, 80 << 30], "r1", "box").mode == "stop-start"
    json.dumps(sw.to_dict())


def test_a_host_without_nvidia_smi_keeps_the_cpu_rule():
    assert room.choose("auto", rel.EngineSettings(), None, "no nvidia-smi", None, "r1", "box").mode == "blue-green"
    assert room.choose("auto", GPU, None, "no nvidia-smi", None, "r1", "box").mode == "stop-start"
    assert room.choose("blue-green", GPU, None, "no nvidia-smi", None, "r1", "box").mode == "blue-green"
