"""The one decode step (Model.decode_step) computes what the prefill path computes for the same position."""

from __future__ import annotations

import pytest

from tests.engine_helpers import random_small_model


def _model(name: str):
    return random_small_model(name, 256)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b", "qwen2.5-0.5b"])
def test_decode_step_matches_the_prefill_forward(name):
    """The one decode step (block by block, additive mask, residual add moved into the next block)
    computes what the prefill path computes for the same position, and writes the same K/V."""
    import torch

    model = _model(name)
    tok, pos = torch.tensor([5]), torch.tensor([37])
    with torch.inference_mode():
        want = model.forward(tok.view(1, 1), 37)  # [V]: attends over cache positions 0..37
        k_want = model.layers[1].k_cache[:, :, 37].clone()
        model.layers[1].k_cache[:, :, 37] = 0  # the step must write it again
        got = model.decode_step(tok, pos, 256)
    assert got.shape == want.shape == (model.cfg.vocab_size,)
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert torch.allclose(model.layers[1].k_cache[:, :, 37], k_want, atol=1e-5)

