"""How the decode step is run, decided without a GPU: the dtype rule, the kernel choice (Triton-compiled
blocks only where Triton targets the card: never on the V100), the context buckets the graphs are
captured for, and the V100's path itself (fp16, the plain blocks) computing what float32 computes."""

from __future__ import annotations

import pytest
import torch

from engine.core import runner
from tests.engine_helpers import small_config


@pytest.mark.parametrize("device,cap,want", [
    ("cpu", None, "float32"),
    ("cuda", (7, 0), "float16"),  # V100: no bf16 tensor cores (torch may emulate it: not a fact)
    ("cuda", (7, 5), "float16"),
    ("cuda", (8, 0), "bfloat16"),
    ("cuda", (9, 0), "bfloat16"),  # H100 / H200
])
def test_dtype_rule(device, cap, want):
    assert runner.dtype_for(device, cap) == want


@pytest.mark.parametrize("device,cap,triton,requested,want,why", [
    ("cuda", (9, 0), True, None, "fused", "five Triton kernels per layer"),  # measured faster (h200, 2026-11-30)
    ("cuda", (8, 0), True, None, "fused", "one kernel for q/k norm, RoPE, the cache write"),
    ("cuda", (7, 0), True, None, "eager", "compute capability 7.0 < 8.0 and no ptxas"),  # none looked for
    ("cuda", (9, 0), False, "fused", "eager", "Triton is not installed"),
    ("cpu", None, True, "fused", "eager", "CPU"),
    ("cuda", (9, 0), False, None, "eager", "Triton is not installed"),
    ("cuda", (9, 0), True, "eager", "eager", "V100PLAN_ENGINE_KERNELS=eager"),
    ("cpu", None, True, None, "eager", "CPU"),
])
def test_kernel_choice_never_requires_triton_where_it_cannot_run(device, cap, triton, requested, want, why):
    got, reason = runner.kernel_choice(device, cap, triton, requested)
    assert got == want and why in reason


def test_context_buckets_double_up_to_the_limit():
    assert runner.buckets(2048) == [256, 512, 1024, 2048]
    assert runner.buckets(1000) == [256, 512, 1000]
    assert runner.buckets(100) == [100]
    assert runner.buckets(32768 + 256) == [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 33024]


def _model(dtype, seed=7):
    from engine.core import config as ecfg
    from engine.core.model import Model
    from engine.core.weights import expected_tensors

    model = Model(ecfg.from_dict(small_config("llama-3.1-8b")), dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for label, t in expected_tensors(model):
            vals = torch.empty(t.shape).normal_(1.0 if "norm" in label else 0.0, 0.1 if t.dim() == 1 else 0.05,
                                                generator=g)
            t.copy_(vals.to(dtype))
        model.setup_cache(256)
    return model


def test_the_v100_path_runs_the_plain_blocks_in_fp16_and_matches_float32():
    """What a V100 runs: dtype float16 by the rule, the plain (uncompiled) blocks by the choice. On CPU
    the same code computes fp16 logits close to float32's (the GPU run adds only the graph around it)."""
    dtype = getattr(torch, runner.dtype_for("cuda", (7, 0)))
    kernels, _ = runner.kernel_choice("cuda", (7, 0), True)
    assert dtype is torch.float16 and kernels == "eager"
    half, full = _model(dtype), _model(torch.float32)
    dec = runner.Decoder(half, kernels=kernels)
    assert dec.kernels == "eager" and dec.info["mode"] == "eager"
    ids = [3, 17, 99, 5, 42, 7]
    with torch.inference_mode():
        half.forward(torch.tensor([ids[:-1]]), 0)
        full.forward(torch.tensor([ids[:-1]]), 0)
        got = dec.logits(ids[-1], len(ids) - 1)
        want = full.decode_step(torch.tensor([ids[-1]]), torch.tensor([len(ids) - 1]), len(ids))
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < 2e-2
    assert int(got.argmax()) == int(want.argmax())


def test_cpu_decoder_says_it_runs_eagerly_and_why():
    dec = runner.Decoder(_model(torch.float32))
    assert dec.info["mode"] == "eager" and dec.info["why"] == "CPU: eager steps"
    assert dec.info["kernels"] == "eager" and dec.info["windows"] is None
    line = runner.describe(dec.info)
    assert line.startswith("decode eager (CPU: eager steps); kernels eager (CPU")


def test_runner_loop_reports_its_host_time_and_token_time():
    from engine.core.sampling import Sampler

    model = _model(torch.float32)
    dec = runner.prepare(model)
    out, reason = runner.run(model, [3, 4, 5], 12, Sampler(), set(), 2)
    assert reason == "length" and len(out) == 12
    st = dec.stats()
    assert st["steps"] == 11 and st["token_ms"] > 0 and st["step_ms"] is None  # no graph replays on CPU
    assert set(st["host_ms"]) == {"sample", "hook", "launch"}
    assert st["achieved_gbps"] == pytest.approx(st["weight_bytes"] / (st["token_ms"] * 1e-3) / 1e9, abs=0.051)


class _AheadDecoder(runner.Decoder):
    """The real eager step, flagged as graphs so runner.run takes its GPU order (next step launched
    before the hook); records the order of steps and hooks."""

    def __init__(self, model, log):
        super().__init__(model)
        self.graphs, self.log = True, log

    def logits(self, tok, pos, flags=None):
        self.log.append(("step", pos))
        if flags is not None:
            self.log.append(("flags", pos, flags))
        self.graphs = False
        try:
            return super().logits(tok, pos)
        finally:
            self.graphs = True


class _GuardedDecoder(_AheadDecoder):
    """As _AheadDecoder, and guarded: a token sampled from a step's logits comes with that step's
    in-graph check (engine.core.lockstep.in_graph on the CPU, the peer played by this rank itself)."""

    def __init__(self, model, log):
        super().__init__(model, log)
        self.guarded = True
        self._state, self._flags, self._from_step = torch.zeros(1, dtype=torch.long), torch.zeros(2, dtype=torch.long), None

    def logits(self, tok, pos, flags=None):
        out = super().logits(tok, pos, flags)
        self._flags.copy_(torch.tensor(flags or (0, 0)))
        self._from_step = (out, pos)
        return out

    def sample(self, sampler, logits):
        from engine.core import lockstep

        tok = super().sample(sampler, logits)
        if self._from_step is not None and self._from_step[0] is logits:
            res = lockstep.in_graph(torch.tensor(tok), torch.tensor([self._from_step[1]]), self._state, self._flags,
                                    lambda x: (x, x))
            self.checked = lockstep.read(res.tolist())
        return tok


def test_on_graphs_the_next_step_is_issued_before_the_hook_and_tokens_do_not_change():
    from engine.core.sampling import Sampler

    model = _model(torch.float32)
    want, _ = runner.run(model, [3, 4, 5], 8, Sampler(), set(), 2)
    log: list = []
    model.decoder = _AheadDecoder(model, log)

    def hook(phase, k, toks, pos):
        log.append((phase, pos))
        return phase == "decode" and k == 5  # cancel at the sixth token

    got, reason = runner.run(model, [3, 4, 5], 8, Sampler(), set(), 2, hook)
    assert reason == "cancelled" and got == want[:5]
    decode = [e for e in log if e[0] != "prefill"]
    # token k (position 3 + k) is handed to the hook only after the step at that position was issued
    for k in range(5):
        assert decode.index(("step", 3 + k)) < decode.index(("decode", 4 + k))
    assert decode[-2:] == [("step", 8), ("decode", 9)]  # the step in flight at the cancel is dropped


def test_a_guarded_decoder_carries_flags_into_the_step_and_hands_its_check_to_the_hook():
    """runner.run's side of lockstep in the graph: the step producing token k carries flags(k); the hook
    for token k finds that step's check (token 0, from prefill, has none: the rank exchanges it)."""
    from engine.core.sampling import Sampler

    model = _model(torch.float32)
    want, _ = runner.run(model, [3, 4, 5], 6, Sampler(), set(), 2)
    log: list = []
    model.decoder = _GuardedDecoder(model, log)
    seen: list = []

    def hook(phase, k, toks, pos):
        if phase == "decode":
            seen.append((k, toks[0], model.decoder.checked))
        return False

    asked: list = []
    got, reason = runner.run(model, [3, 4, 5], 6, Sampler(), set(), 2, hook,
                             flags=lambda k: asked.append(k) or (0, int(k == 4)))
    assert reason == "length" and got == want
    assert asked == [1, 2, 3, 4, 5]
    assert seen[0][2] is None
    for k, tok, chk in seen[1:]:
        assert chk["token"] == tok and chk["agree"] == 1  # the peer is itself: equal even when corrupted
    # the corrupt flag reached the step that produced token 4 (position 3 + 3), and only that one
    assert [e for e in log if e[0] == "flags"] == [("flags", 3 + k, (0, int(k + 1 == 4))) for k in range(5)]
    # sampled tokens are never guarded: no flags asked
    asked.clear()
    runner.run(model, [3, 4, 5], 4, Sampler(0.8, seed=1), set(), 2, hook, flags=lambda k: asked.append(k) or (0, 0))
    assert asked == []
