"""Shared, session-scoped engine fixtures: the demo model and small random models of real architectures."""

from __future__ import annotations

import collections.abc
import contextlib
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def one_torch_thread():
    """Tiny models on one thread: more only spin against the other processes on the machine (15x slower)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
CONFIGS = Path(__file__).resolve().parent / "fixtures" / "engine" / "configs"

# Real config.json values, shrunk so a model runs in milliseconds on CPU: width, depth and vocabulary
# change; rope settings, norms, biases, q/k norms, tying and head_dim != hidden / heads stay as published.
SHRINK = {
    "llama-3.1-8b": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2),
    "qwen3-8b": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=48),
    "qwen2.5-0.5b": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2),
}


def small_config(name: str) -> dict:
    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    raw.update(num_hidden_layers=2, vocab_size=512, intermediate_size=256, max_position_embeddings=4096,
               bos_token_id=1, eos_token_id=2)
    raw.update(SHRINK[name])
    raw.pop("torch_dtype", None)
    return raw


def random_small_model(name: str, max_context: int, **override):
    """A float32 CPU Model of small_config(name) (updated with ``override``): every tensor random, norms and
    biases too (so folding mistakes show), a cache of ``max_context`` positions set up and its K/V random;
    generator seed 7."""
    import torch

    from engine.core import config as ecfg
    from engine.core.model import Model
    from engine.core.weights import expected_tensors

    raw = small_config(name)
    raw.update(override)
    model = Model(ecfg.from_dict(raw), dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for label, t in expected_tensors(model):
            t.normal_(1.0 if "norm" in label else 0.0, 0.1 if t.dim() == 1 else 0.05, generator=g)
        model.setup_cache(max_context)
        for layer in model.layers:
            layer.k_cache.normal_(generator=g)
            layer.v_cache.normal_(generator=g)
    return model


def state_tensors(model) -> list:
    """Every per-sequence state pool a model holds after setup_cache (each layer's ``state()``), the MTP draft
    layers' last: K/V caches (and their int8 scales), conv rings and recurrent states, layer by layer."""
    layers = model.layers + (model.mtp.layers if model.mtp is not None else [])
    return [t for la in layers for t in la.state()]


def snapshot_state(model) -> list:
    return [t.clone() for t in state_tensors(model)]


def restore_state(model, saved: list) -> None:
    for t, s in zip(state_tensors(model), saved, strict=True):
        t.copy_(s)


def make_hf_model(name: str, out: Path):
    """A transformers model with random weights from the shrunk real config, saved as safetensors."""
    import torch
    import transformers

    raw = small_config(name)
    cfg = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.1)
            elif "bias" in n:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)  # wider than init so greedy choices are not near-ties
    model.save_pretrained(out, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    from engine.core import demo

    d = tmp_path_factory.mktemp("demo") / "v100plan-demo"
    demo.make(d)
    return d


def interpreter_spec(path: str, env_drop: tuple[str, ...] = ()):
    """The child pytest that runs a cases file (tests/engine_*_cases.py) under Triton's interpreter: a spec for
    tests/early.py (a test that takes ``@pytest.mark.early(interpreter_spec(path))`` has it started early)."""
    from tests import early

    return early.Spec("pytest", ("-q", "-p", "no:cacheprovider", "-x", path),
                      set_env=(("TRITON_INTERPRET", "1"), ("CUDA_VISIBLE_DEVICES", "")), drop_env=env_drop,
                      timeout_s=900)


def run_interpreter_cases(path: str, at_least: int, env_drop: tuple[str, ...] = ()) -> None:
    """Run a cases file (tests/engine_*_cases.py) in a child pytest under Triton's interpreter: TRITON_INTERPRET=1
    must be set before triton is first imported, and torch.compile in other tests imports it. Asserts it
    passed with at least ``at_least`` tests and none skipped. The child may have been started early
    (tests/early.py); its result is the same."""
    import re

    from tests import early

    res = early.run(interpreter_spec(path, env_drop))
    tail = res.stdout[-3000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    m = re.search(r"(\d+) passed", res.stdout)
    assert m and int(m.group(1)) >= at_least and "skipped" not in res.stdout.splitlines()[-1], tail


class _WatchedEnviron(collections.abc.MutableMapping):
    """os.environ that fails a read made by code of ``packages`` (others, e.g. Triton's interpreter, read on)."""

    _PASS_THROUGH = ("collections.abc", "_collections_abc", "os", __name__)  # frames between the reader and _check

    def __init__(self, real, packages: tuple[str, ...]):
        self.real, self.packages, self.reads = real, packages, []

    def _check(self, key) -> None:
        f = sys._getframe(1)
        while f is not None and f.f_globals.get("__name__") in self._PASS_THROUGH:
            f = f.f_back
        name = (f.f_globals.get("__name__") or "") if f is not None else ""
        if name.startswith(self.packages):
            self.reads.append((name, key))
            raise AssertionError(f"{name} read the environment ({key!r}) during a decode step")

    def __getitem__(self, key):
        self._check(key)
        return self.real[key]

    def __iter__(self):
        self._check(None)
        return iter(self.real)

    def __len__(self):
        return len(self.real)

    def __setitem__(self, key, value):
        self.real[key] = value

    def __delitem__(self, key):
        del self.real[key]


@contextlib.contextmanager
def no_environment_reads(packages: tuple[str, ...] = ("engine.",)):
    """Within: a read of os.environ by code under ``packages`` raises AssertionError (and is listed in the yielded
    object's ``reads``, in case the code swallowed the error)."""
    watched = _WatchedEnviron(os.environ, packages)
    os.environ = watched
    try:
        yield watched
    finally:
        os.environ = watched.real


def eager_and_static_step(m, model_dir, ids, window: int):
    """The last token of ids [1, T] through the prefill (``m``, after ids[:-1]) and through THE decode step (a
    second model loaded from ``model_dir``, after the same prefill): (eager logits, static logits, that model)."""
    import torch

    from engine.core import weights
    from engine.core.model import Model

    m2 = Model(m.cfg)
    weights.load_into(m2, model_dir)
    m2.setup_cache(m.max_context)
    t = ids.shape[1] - 1
    m.forward(ids[:, :t], 0)
    eager = m.forward(ids[:, t:], t)
    m2.forward(ids[:, :t], 0)
    with torch.inference_mode():
        static = m2.decode_step(ids[0, t:], torch.tensor([t]), window)
    return eager, static, m2


def spread_hybrid_weights(hf) -> None:
    """A transformers Qwen3.5 / Qwen3-Next model's random weights made decisive for the oracle tests: decay rates
    as the models initialise them, norms off their unit (zero-centred: 1 + w), matrices wider than init so greedy
    choices are not near-ties, and a MoE router wider still (no near-tie between the k-th and the next expert)."""
    import torch

    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("A_log"):
                p.uniform_(0.0, 2.7)
            elif n.endswith("dt_bias"):
                p.uniform_(0.5, 1.5)
            elif "norm" in n:
                p.normal_(0.0, 0.1)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.08)
