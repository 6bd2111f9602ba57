"""YaRN RoPE scaling (Qwen3's way past its native context: rope_scaling yarn, factor 4 or 8) judged against
transformers: the same inverse frequencies and cos/sin factor, and the same logits at positions past the original
context on the same random weights."""

from __future__ import annotations

import math

import pytest
import torch

from engine.core import config as ecfg
from engine.core import model as emodel
from engine.core import weights
from tests.engine_helpers import small_config

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}


def _raw(**scaling):
    raw = small_config("qwen3-8b")
    raw["max_position_embeddings"] = 2048
    raw["rope_scaling"] = dict(YARN, **scaling)
    raw.pop("rope_parameters", None)
    return raw


@pytest.mark.parametrize("extra", [{}, {"factor": 8.0, "beta_fast": 16}, {"mscale": 0.707, "mscale_all_dim": 1.0},
                                   {"attention_factor": 1.3}, {"truncate": False}])
def test_inverse_frequencies_and_factor_are_transformers(extra):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = _raw(**extra)
    hf_cfg = transformers.AutoConfig.for_model(**raw)
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    cfg = ecfg.from_dict(raw)
    assert torch.allclose(emodel.inv_freq(cfg), ref_freq.float(), rtol=1e-6, atol=0)
    assert math.isclose(emodel.rope_attention_factor(cfg), ref_factor, rel_tol=1e-9)
    assert emodel.rope_attention_factor(ecfg.from_dict(small_config("qwen3-8b"))) == 1.0


def test_logits_past_the_original_context_equal_transformers(tmp_path):
    import transformers

    raw = _raw()
    hf_cfg = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(99)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in n else 0.0, 0.1 if "norm" in n else 0.08)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    m = emodel.Model(ecfg.load(tmp_path))
    weights.load_into(m, tmp_path)
    m.setup_cache(1024)
    ids = torch.randint(0, 512, (1, 900), generator=torch.Generator().manual_seed(3))  # past 512 positions
    with torch.no_grad():
        ref = hf(ids).logits[0, -64:]
    m.forward(ids[:, :700], 0)
    got = m.forward(ids[:, 700:], 700, all_logits=True)[-64:]
    assert (got - ref).abs().max().item() < 1e-4 * ref.abs().max().item()


def test_a_yarn_without_its_factor_is_refused():
    raw = _raw()
    raw["rope_scaling"].pop("factor")
    with pytest.raises(ecfg.ConfigError, match="factor"):
        ecfg.from_dict(raw)
