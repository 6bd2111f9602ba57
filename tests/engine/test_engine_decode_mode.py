"""The one DecodeMode (engine/core/decode_mode.py): resolved once from the request and the card's facts without a GPU,
recorded in the Decoder's info with the keys the service reports, and the only thing a step goes by: with the
environment made to fail any read by engine code, steps (and an int4 launch's PDL question) still run. Also that the GEMV and the
exchange's allreduce side do not import each other, and decode_mode stays stdlib only."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.core import decode_mode, runner
from engine.core.decode_mode import DecodeMode, Request
from engine.kernels import gemv_int4
from tests.engine_helpers import REPO, no_environment_reads, small_config

H200 = dict(device_type="cuda", capability=(9, 0), triton_ok=True, sm70_ptxas=None)
MAILBOX = dict(path_name="device_mailbox_graph", capturable=True)


def _resolve(request=Request(), offered=True, lockstep_kernels=True, **facts) -> DecodeMode:
    kw = {**H200, **MAILBOX, **facts}
    return decode_mode.resolve(request, exchange_offered=lambda kernels: offered and kernels == "fused",
                               lockstep_kernels=lockstep_kernels, **kw)


def test_two_h200_ranks_run_graphs_fused_kernels_the_send_exchange_and_the_lockstep_kernels():
    m = _resolve()
    assert (m.graphs, m.kernels, m.exchange, m.lockstep) == (True, "fused", "send", "graph-kernels")
    assert m.exchange_why == decode_mode.EXCHANGES["send"] and m.lockstep_kernels is True
    assert m.graphs_why == "CUDA graphs per context bucket, allreduce device_mailbox_graph captured inside"
    assert m.lockstep_why.startswith("in the step's graph (greedy tokens") and "two Triton kernels" in m.lockstep_why
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.exchange = "kernel"


def test_the_info_keeps_the_keys_and_values_the_service_reports():
    m = _resolve()
    assert m.info() == {"mode": "graphs", "why": m.graphs_why, "kernels": "fused", "kernels_why": m.kernels_why,
                        "exchange": "send", "exchange_why": m.exchange_why, "lockstep": m.lockstep_why}
    one = _resolve(path_name=None)  # TP1: nothing exchanged, nothing checked, no exchange keys
    assert (one.exchange, one.lockstep) == (None, None) and "exchange" not in one.info()
    assert one.info()["lockstep"] is None and one.graphs_why == "CUDA graphs per context bucket"


@pytest.mark.parametrize("facts,request_,offered,want", [
    ({}, Request(exchange="kernel"), True, ("kernel", "an allreduce (device_mailbox_graph) between the GEMVs")),
    ({}, Request(), False, ("kernel", "an allreduce (device_mailbox_graph) between the GEMVs")),  # not offered
    ({}, Request(kernels="eager"), True, ("kernel", "an allreduce")),  # plain blocks take no tickets
    ({"path_name": "nccl"}, Request(), False, ("kernel", "an allreduce (nccl) between the GEMVs")),
    ({}, Request(exchange="send"), True, ("send", "a small kernel waits for and adds them")),
])
def test_the_exchange_is_the_requested_mode_only_where_the_blocks_and_the_path_take_it(facts, request_, offered, want):
    m = _resolve(request_, offered, **facts)
    assert m.exchange == want[0] and want[1] in m.exchange_why


def test_deleted_modes_are_refused_with_the_modes_there_are():
    for old in ("gemv", "norm-receive", "sideways"):  # the deleted exchange modes (docs/engine-speed.md, history)
        with pytest.raises(ValueError, match="expected one of kernel, send"):
            Request.of(environ={decode_mode.EXCHANGE_ENV: old})
    for old in ("gemv", "compiled", "fast"):
        with pytest.raises(ValueError, match=f"V100PLAN_ENGINE_KERNELS='{old}': expected one of eager, fused"):
            Request.of(environ={decode_mode.KERNELS_ENV: old})
    # an argument wins over the environment
    assert Request.of(kernels="eager", exchange="kernel", environ={decode_mode.KERNELS_ENV: "fused",
                                                                    decode_mode.EXCHANGE_ENV: "send"}) == \
        Request(None, "eager", "kernel")


def test_graphs_and_lockstep_follow_the_device_and_the_path():
    cpu = _resolve(device_type="cpu", capability=None, path_name="gloo", capturable=False, lockstep_kernels=False)
    assert (cpu.graphs, cpu.kernels, cpu.exchange, cpu.lockstep) == (False, "eager", "kernel", "after-step")
    assert cpu.graphs_why == "CPU: eager steps" and cpu.lockstep_why == "after each step"
    assert cpu.lockstep_kernels is None
    host = _resolve(path_name="host_mailbox", capturable=False, offered=False)
    assert not host.graphs and "waits on the host" in host.graphs_why and host.lockstep == "after-step"
    v100 = _resolve(capability=(7, 0), sm70_ptxas=(True, "ptxas 12.8"), lockstep_kernels=False)
    assert v100.kernels == "fused" and v100.lockstep == "graph-torch" and "torch ops" in v100.lockstep_why
    assert v100.lockstep_kernels is False
    forced = _resolve(Request(graphs=False))
    assert not forced.graphs and forced.graphs_why == "requested" and forced.lockstep == "after-step"


def _model(comm=None):
    from engine.core import config as ecfg
    from engine.core.model import Model
    from engine.core.weights import expected_tensors

    m = Model(ecfg.from_dict(small_config("llama-3.1-8b")), world=2 if comm else 1, dtype=torch.float32,
              device="cpu", comm=comm)
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for label, t in expected_tensors(m):
            t.copy_(torch.empty(t.shape).normal_(1.0 if "norm" in label else 0.0, 0.05, generator=g))
        m.setup_cache(64)
    return m


class _Loopback:
    """A one-process stand-in for the peer: it holds the same half of the weights, so the sums are twice this
    rank's partials (the plumbing, not the arithmetic, is under test)."""

    class path:
        name = "gloo"
        capturable = False

    def allreduce_sum(self, x):
        return x + x

    def gather_last(self, x):
        return torch.cat((x, x), dim=-1)


@pytest.mark.parametrize("comm", [None, _Loopback()], ids=["tp1", "tp2-loopback"])
def test_steps_read_nothing_from_the_environment_once_the_decoder_is_built(comm, monkeypatch):
    from engine.core.sampling import Sampler

    monkeypatch.setenv(decode_mode.KERNELS_ENV, "eager")
    model = _model(comm)
    dec = runner.prepare(model, prefix_cache_bytes=0)
    assert isinstance(dec.mode, DecodeMode) and dec.info["kernels_why"] == "V100PLAN_ENGINE_KERNELS=eager"
    assert {k: dec.info[k] for k in dec.mode.info()} == dec.mode.info()
    assert dec.info.get("exchange") == (None if comm is None else "kernel")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))  # an int4 launch on an H200 asks
    monkeypatch.setattr(gemv_int4, "interpreting", lambda: False)
    with no_environment_reads() as watched:
        out, reason = runner.run(model, [3, 4, 5, 6], 6, Sampler(), set(), 2)
        with torch.inference_mode():
            dec.logits(out[-1], 10)
        gemv_int4.pdl_enabled(torch.device("cuda", 0))
    assert reason == "length" and len(out) == 6 and not watched.reads


def test_the_environment_watch_catches_a_read_by_the_engine():
    with no_environment_reads() as watched, pytest.raises(AssertionError, match="engine.core.decode_mode read"):
        Request.of()  # reads V100PLAN_ENGINE_KERNELS: what a Decoder does once, when it is built
    assert watched.reads and watched.reads[0][0] == "engine.core.decode_mode"


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_the_gemv_and_the_exchange_paths_do_not_import_each_other():
    gemv, epilogue = _imports(REPO / "engine/kernels/decode.py"), _imports(REPO / "engine/allreduce/epilogue.py")
    assert not [m for m in gemv if m.startswith("engine.allreduce")], gemv
    assert not [m for m in epilogue if m.startswith("engine.kernels.decode")], epilogue
    shared = set().union(*(_imports(REPO / "engine/kernels" / f) for f in (
        "exchange.py", "exchange_jit.py", "rounding_jit.py", "interpreter.py")))
    assert not [m for m in shared if m.startswith(("engine.kernels.decode", "engine.allreduce"))], shared
    code = ("import sys, engine.allreduce.epilogue as e; a = 'engine.kernels.decode' in sys.modules; "
            "import engine.kernels.decode; print(a, e.EpilogueExchange.__module__)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.split() == ["False", "engine.kernels.exchange"], res.stderr[-2000:]
    code = "import sys, engine.kernels.decode; print('engine.allreduce.epilogue' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.split() == ["False"], res.stderr[-2000:]


def test_every_triton_kernel_is_at_module_level_and_no_engine_module_reads_the_environment_at_import():
    # (engine/kernels, engine/model and engine/tuning not at all: the decoder reads their settings when it is built)
    def at_import(node):  # what runs when the module is imported: not the bodies of its functions
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from (n for d in getattr(child, "decorator_list", []) for n in ast.walk(d))
            else:
                yield child
                yield from at_import(child)

    nested, reads = [], []
    for path in sorted((REPO / "engine").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            nested += [f"{path.name}:{inner.name}" for inner in ast.walk(fn) if inner is not fn
                       and isinstance(inner, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in inner.decorator_list)]
        floor = path.parent.name in ("kernels", "model", "tuning")  # these read no environment at all
        reads += [f"{path.name}:{n.lineno}" for n in (ast.walk(tree) if floor else at_import(tree))
                  if isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv")]
    assert not nested and not reads, (nested, reads)


def test_decode_mode_imports_the_standard_library_only():
    mods = {m.split(".")[0] for m in _imports(REPO / "engine/core/decode_mode.py")}
    assert mods <= set(sys.stdlib_module_names) | {"__future__"}, mods


def test_the_gemv_kernels_name_their_prologues():
    import importlib.util
    import re

    from engine.kernels import prologue

    for f in ("gemv_jit.py", "gemv_int4_jit.py"):  # named constants, not bare numbers
        assert not re.findall(r"PROLOGUE\s*==\s*\d", (REPO / "engine/kernels" / f).read_text()), f
    assert [int(p) for p in prologue.Prologue] == [prologue.PROLOGUE_PLAIN, prologue.PROLOGUE_NORM,
                                                   prologue.PROLOGUE_SILU] == [0, 1, 2]
    assert [prologue.PROLOGUE_NAMES[p] for p in prologue.Prologue] == ["plain", "norm", "silu"]
    if importlib.util.find_spec("triton") is not None:  # the kernels' constants are the enum's values
        from engine.kernels import prologue_jit as pj

        assert [c.value for c in (pj.PRO_PLAIN, pj.PRO_NORM, pj.PRO_SILU)] == [0, 1, 2]
