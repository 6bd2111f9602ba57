"""The TP2 exchange inside the decode step's GEMVs (engine/allreduce/epilogue.py): the kernels on CPU under
Triton's interpreter in a child pytest (tests/engine_exchange_cases.py: bit-exact sums, stale words refused,
two ranks in two processes decoding equal to the allreduce path and to TP1), and where it is chosen."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.allreduce import epilogue
from engine.core import decode_mode, runner
from engine.core.model import Model
from engine.kernels import decode
from tests.engine_helpers import interpreter_spec, run_interpreter_cases


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed: the fused kernels cannot run (pip install triton)")
@pytest.mark.early(interpreter_spec("tests/engine_exchange_cases.py", (decode_mode.EXCHANGE_ENV,)))
def test_the_exchange_kernels_under_the_triton_interpreter():
    run_interpreter_cases("tests/engine_exchange_cases.py", 6, env_drop=(decode_mode.EXCHANGE_ENV,))


class _Path:
    name = "device_mailbox_graph"

    def __init__(self):
        self.made = 0

    def epilogue(self):
        self.made += 1
        return "xs"


class _Comm:
    def __init__(self, path):
        self.path = path


def _tiny(comm=None) -> Model:
    from engine.core import config as ecfg
    from tests.engine_helpers import small_config

    raw = small_config("qwen3-8b")
    raw.update(head_dim=64)
    m = Model(ecfg.from_dict(raw), world=2 if comm else 1, dtype=torch.float32, device="cpu", comm=comm)
    m.setup_cache(32)
    return m


def test_the_exchange_goes_inside_the_gemvs_only_with_fused_blocks_that_run_and_a_path_that_offers_it(monkeypatch):
    path = _Path()
    model = _tiny(_Comm(path))
    fused = "fused"
    assert model.epilogue_exchange(fused, "send") is None  # CPU: the fused blocks run the plain code here
    monkeypatch.setattr(decode, "CPU_KERNELS", True)
    monkeypatch.setattr(decode, "interpreting", lambda: True)
    assert model.offers_exchange(fused)
    assert model.epilogue_exchange(None, "send") is None  # plain blocks take no tickets
    assert model.epilogue_exchange("eager", "send") is None
    assert model.epilogue_exchange(fused, "send") == "xs"  # sent by the GEMVs, received by a kernel
    assert model.epilogue_exchange(fused, "kernel") is None  # the allreduce kernels
    assert model.epilogue_exchange(fused, None) is None  # a step given no mode: the path's allreduce
    # the environment is not read by the step: only the mode it is given counts
    monkeypatch.setenv("V100PLAN_ENGINE_EXCHANGE", "send")
    assert model.epilogue_exchange(fused, "kernel") is None
    assert _tiny().epilogue_exchange(fused, "send") is None  # TP1: nothing to exchange
    plain = _tiny(_Comm(object()))  # a path without the exchange (host mailbox, NCCL)
    assert plain.epilogue_exchange(fused, "send") is None and not plain.offers_exchange(fused)
    odd = _tiny(_Comm(_Path()))
    odd.layers[0].hd = 48  # a head dimension the attention kernel does not take: the plain attention adds delta
    assert odd.epilogue_exchange(fused, "send") is None


def test_tickets_refuse_rows_that_do_not_fit_and_too_many_exchanges():
    inbox = torch.zeros(2, 64, dtype=torch.int64)
    xs = epilogue.EpilogueExchange(inbox=inbox, peer_inbox=inbox.clone(), rank=0, timeout_ns=1,
                                   failed=torch.zeros(1, dtype=torch.int32))
    t = xs.ticket(3, 128, torch.bfloat16)  # 128 values in 64 words
    assert t.slot == 1 and t.e == 3
    with pytest.raises(ValueError, match="exceeds"):
        xs.ticket(0, 128, torch.float32)
    with pytest.raises(ValueError, match="at most 256"):
        xs.ticket(256, 2, torch.bfloat16)
    with pytest.raises(ValueError, match="int64"):
        epilogue.EpilogueExchange(inbox=inbox.int(), peer_inbox=inbox, rank=0, timeout_ns=1,
                                  failed=torch.zeros(1, dtype=torch.int32))


def test_the_log_line_says_where_the_exchange_runs():
    info = {"mode": "graphs", "why": "CUDA graphs", "kernels": "fused", "kernels_why": "x", "windows": [256],
            "capture_s": 1.0, "allreduce": "device_mailbox_graph", "exchange": "send",
            "exchange_why": decode_mode.EXCHANGES["send"]}
    line = runner.describe(info)
    assert "exchange send (o_proj / down send their rows" in line
