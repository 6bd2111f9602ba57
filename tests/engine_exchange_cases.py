"""Cases run by tests/engine/test_engine_exchange.py in a child pytest under Triton's interpreter (TRITON_INTERPRET=1
before triton is first imported; the file name keeps the main run from collecting it).

The TP2 exchange inside the decode step's GEMVs (engine/allreduce/epilogue.py, the SEND / RECV parts of
engine/kernels/decode.py's prologue kernel and its finish kernel) on CPU tensors:
  - kernel by kernel, the two ranks' inboxes cross-wired in one process: what a norm GEMV receives is bit for
    bit what it computes from torch's ``part0 + part1``; the finish kernel gives the sum and bumps the serial;
    a receive whose peer has not sent this step's words (stale words of an earlier step in the slot) does not
    take them: it waits, times out and sets the failed flag;
  - whole decode steps of two ranks in two processes (the interpreter is one per process) spinning on shared
    memory as the GPUs spin on their inboxes: the step with the exchange in the GEMVs equals, bit for bit,
    the same ranks' step with a separate allreduce, and TP1's logits to rounding.
On two GPUs: tests/engine/test_multigpu_gpu.py (the served bench and `generate --tp 2` run the same code)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from engine.allreduce.epilogue import EpilogueExchange
from engine.core.model import rms_norm
from engine.kernels import decode
from tests.engine_helpers import no_environment_reads, random_small_model

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/engine/test_engine_exchange.py with TRITON_INTERPRET=1", allow_module_level=True)

EPS = 1e-6
WORDS = 512
PATIENT = 10 ** 12  # ns (the interpreter counts one microsecond per spin): never gives up in these tests


@pytest.fixture(autouse=True)
def kernels_on_cpu(monkeypatch):
    monkeypatch.setattr(decode, "CPU_KERNELS", True)


def _pair(timeout_ns: int = PATIENT, shared: bool = False) -> list[EpilogueExchange]:
    boxes = [torch.zeros(2, WORDS, dtype=torch.int64) for _ in range(2)]
    failed = [torch.zeros(1, dtype=torch.int32) for _ in range(2)]
    serial = [torch.zeros(1, dtype=torch.int32) for _ in range(2)]
    if shared:
        for t in boxes + failed + serial:
            t.share_memory_()
    return [EpilogueExchange(inbox=boxes[r], peer_inbox=boxes[1 - r], rank=r, timeout_ns=timeout_ns,
                             failed=failed[r], serial=serial[r]) for r in (0, 1)]


def _t(*shape, dtype, g, scale=1.0, mean=0.0):
    return (mean + scale * torch.randn(*shape, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_exchanged_inside_the_gemvs_is_torch_sum_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(3)
    d, k_heads, ff = 128, 96, 80
    xs = _pair()
    # o_proj of each rank's heads, sent (exchange 0 of the step)
    a = [_t(1, 1, k_heads, dtype=dtype, g=g) for _ in range(2)]
    wo = [_t(d, k_heads, dtype=dtype, g=g, scale=0.1) for _ in range(2)]
    sent = [decode.linear_send(a[r], wo[r], None, xs[r].ticket(0, d, dtype)) for r in (0, 1)]
    for r in (0, 1):
        plain = decode.launch_prologue(decode.PROLOGUE_PLAIN, a[r].reshape(-1), wo[r], None,
                                       torch.empty(d, dtype=dtype))
        assert torch.equal(sent[r].part.reshape(-1), plain)  # the local rows are the plain GEMV's
        assert float((sent[r].part.float() - F.linear(a[r].float(), wo[r].float())).norm()) < 0.05 * float(
            sent[r].part.float().norm())
    # each rank's receive kernel sums the peer's rows with its own: what the allreduce gives both ranks
    x = _t(1, 1, d, dtype=dtype, g=g)
    nw = _t(d, dtype=dtype, g=g, scale=0.1, mean=1.0)
    delta = sent[0].part + sent[1].part
    for r in (0, 1):
        assert torch.equal(xs[r].receive(sent[r]), delta)
    assert int(xs[0].failed) == 0 and int(xs[1].failed) == 0
    # SiLU + down, sent (exchange 1), received by the finish kernel: the sum, and the serial bumped
    gu = [_t(1, 1, 2 * ff, dtype=dtype, g=g) for _ in range(2)]
    w2 = [_t(d, ff, dtype=dtype, g=g, scale=0.1) for _ in range(2)]
    sent = [decode.linear_silu(gu[r], w2[r], None, send=xs[r].ticket(1, d, dtype)) for r in (0, 1)]
    for r in (0, 1):
        assert torch.equal(sent[r].part, decode.linear_silu(gu[r], w2[r]))
    want = sent[0].part + sent[1].part
    for r in (0, 1):
        got = xs[r].receive(sent[r])  # mode "send": a kernel of its own, the serial left alone
        assert got.shape == want.shape and torch.equal(got, want) and int(xs[r].serial) == 0
    for r in (0, 1):
        got = xs[r].finish(sent[r])
        assert got.shape == want.shape and torch.equal(got, want)
        assert int(xs[r].serial) == 1
    # the step's last exchange with the model's final norm folded in
    sent = [decode.linear_silu(gu[r], w2[r], None, send=xs[r].ticket(1, d, dtype)) for r in (0, 1)]
    want = rms_norm(x + (sent[0].part + sent[1].part), nw, EPS)
    ref = rms_norm(x.float() + (sent[0].part + sent[1].part).float(), nw.float(), EPS)
    normed = [xs[r].finish(sent[r], x, nw, EPS) for r in (0, 1)]
    assert torch.equal(normed[0], normed[1]) and int(xs[0].serial) == 2
    if dtype == torch.float32:
        assert float((normed[0] - want).norm() / want.norm()) < 1e-6
    else:  # as close to float32 as the eager bf16 norm is
        assert float((normed[0].float() - ref).norm()) <= 1.5 * float((want.float() - ref).norm()) + 1e-3


def test_a_receive_never_takes_an_earlier_steps_words_it_waits_and_fails():
    g = torch.Generator().manual_seed(4)
    dtype, d = torch.bfloat16, 64
    xs = _pair()
    parts = [_t(1, 1, 16, dtype=dtype, g=g) for _ in range(2)]
    wo = [_t(d, 16, dtype=dtype, g=g) for _ in range(2)]
    step0 = [decode.linear_send(parts[r], wo[r], None, xs[r].ticket(0, d, dtype)) for r in (0, 1)]
    for r in (0, 1):
        xs[r].receive(step0[r])
        xs[r].serial.add_(1)  # the next step (the finish kernel's bump)
    assert xs[0].failed.item() == 0
    # step 1: rank 1 has not sent yet; slot 0 still holds its step-0 words
    xs[0].timeout_ns = 50_000  # 50 spins
    mine = decode.linear_send(parts[0], wo[0], None, xs[0].ticket(0, d, dtype))
    xs[0].receive(mine)
    assert xs[0].failed.item() == 1  # waited, gave up, told the host
    # the finish kernel gives up the same way
    xs[0].failed.zero_()
    out = xs[0].finish(decode.linear_send(parts[0], wo[0], None, xs[0].ticket(1, d, dtype)))
    assert xs[0].failed.item() == 1 and out.shape == (1, 1, d)


# ---- whole decode steps, two ranks in two processes -------------------------------------------------------

def _model(name: str, dtype, **override):
    model = random_small_model(name, 96, **override)
    if dtype != torch.float32:
        model = _cast(model, dtype)
    return model


def _cast(model, dtype):
    from engine.core.model import Model

    out = Model(model.cfg, dtype=dtype, device="cpu")
    out.setup_cache(model.max_context)
    with torch.inference_mode():
        for dst, src in ((out.embed, model.embed), (out.head, model.head), (out.norm, model.norm)):
            dst.copy_(src)
        for lo, li in zip(out.layers, model.layers):
            for k, t in li.weights().items():
                getattr(lo.owner(k), k).copy_(t)
    return out


def _rank_model(full, rank: int, comm):
    """Rank ``rank`` of two: the tensors split as engine.core.tp's rules split a checkpoint."""
    from engine.core.model import Model

    cfg = full.cfg
    m = Model(cfg, world=2, rank=rank, dtype=full.dtype, device="cpu", comm=comm)
    m.setup_cache(full.max_context)

    def half(t, dim):
        n = t.shape[dim] // 2
        return t.narrow(dim, rank * n, n)

    with torch.inference_mode():
        m.embed.copy_(full.embed)
        m.norm.copy_(full.norm)
        m.head.copy_(half(full.head, 0))
        for lo, li in zip(m.layers, full.layers):
            hd = li.hd
            q, k, v = li.wqkv.split([li.n_heads * hd, li.n_kv * hd, li.n_kv * hd])
            lo.wqkv.copy_(torch.cat([half(q, 0), half(k, 0), half(v, 0)]))
            if li.bqkv is not None:
                bq, bk, bv = li.bqkv.split([li.n_heads * hd, li.n_kv * hd, li.n_kv * hd])
                lo.bqkv.copy_(torch.cat([half(bq, 0), half(bk, 0), half(bv, 0)]))
            gate, up = li.mlp.w13.chunk(2)
            lo.mlp.w13.copy_(torch.cat([half(gate, 0), half(up, 0)]))
            if li.mlp.b13 is not None:
                bg, bu = li.mlp.b13.chunk(2)
                lo.mlp.b13.copy_(torch.cat([half(bg, 0), half(bu, 0)]))
            lo.wo.copy_(half(li.wo, 1))
            lo.mlp.w2.copy_(half(li.mlp.w2, 1))
            for name in ("input_norm", "post_norm", "q_norm", "k_norm", "bo", "b2"):
                if getattr(li.owner(name), name) is not None:
                    getattr(lo.owner(name), name).copy_(getattr(li.owner(name), name))
            lo.k_cache.copy_(half(li.k_cache, 1))
            lo.v_cache.copy_(half(li.v_cache, 1))
    return m


class _Path:
    name = "device_mailbox_graph"

    def __init__(self, xs):
        self.xs = xs

    def epilogue(self):
        return self.xs


class _ProcComm:
    """Two processes' all_gather through shared memory and a barrier; the exchange inside the GEMVs via
    ``path.epilogue()``."""

    def __init__(self, rank, xs, slots, barrier):
        self.rank, self.slots, self.barrier = rank, slots, barrier
        self.path = _Path(xs)

    def _gather(self, x):
        flat = x.reshape(-1)
        self.slots[self.rank, :flat.numel()].copy_(flat.to(self.slots.dtype))
        self.barrier.wait()
        a = self.slots[0, :flat.numel()].to(x.dtype).view(x.shape).clone()
        b = self.slots[1, :flat.numel()].to(x.dtype).view(x.shape).clone()
        self.barrier.wait()
        return a, b

    def allreduce_sum(self, x):
        a, b = self._gather(x)
        return a + b

    def gather_last(self, x):
        a, b = self._gather(x)
        return torch.cat((a, b), dim=-1)


def _rank_main(rank, name, dtype, override, xs, slots, barrier, results):
    decode.CPU_KERNELS = True
    full = _model(name, dtype, **override)
    model = _rank_model(full, rank, _ProcComm(rank, xs, slots, barrier))
    tok, pos = torch.tensor([5]), torch.tensor([40])
    fused = "fused"
    assert model.offers_exchange(fused) and model.epilogue_exchange(fused, "send") is xs  # as a Decoder asks
    # the exchange mode comes in with the step (a DecodeMode's), never from the environment
    with torch.inference_mode(), no_environment_reads() as watched:
        results[rank, 0].copy_(model.decode_step(tok, pos, 64, fused, "send"))  # received by a kernel of its own
        results[rank, 2, 0] = float(xs.serial.item())
        results[rank, 3].copy_(model.decode_step(tok, pos, 64, fused, "send"))  # the next step: the next tags
        results[rank, 2, 1] = float(xs.serial.item())
        assert model.epilogue_exchange(fused, "kernel") is None
        results[rank, 1].copy_(model.decode_step(tok, pos, 64, fused, "kernel"))  # the same ranks, an allreduce
    assert not watched.reads, watched.reads


@pytest.mark.parametrize("name,override,dtype", [
    ("qwen3-8b", {"head_dim": 64}, torch.float32),  # q/k norm
    ("llama-3.1-8b", {}, torch.bfloat16),  # head dim 32, bf16 words carry two values
])
def test_two_ranks_decode_with_the_exchange_inside_the_gemvs(name, override, dtype):
    full = _model(name, dtype, **override)
    vocab = full.cfg.vocab_size
    xs = _pair(shared=True)
    slots = torch.zeros(2, vocab, dtype=torch.float32).share_memory_()
    results = torch.zeros(2, 4, vocab, dtype=torch.float32).share_memory_()
    ctx = mp.get_context("spawn")  # a fork would inherit the parent's OpenMP pool mid-use and hang
    barrier = ctx.Barrier(2, timeout=600)
    procs = [ctx.Process(target=_rank_main, args=(r, name, dtype, override, xs[r], slots, barrier, results))
             for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)
    assert [p.exitcode for p in procs] == [0, 0]
    assert xs[0].failed.item() == 0 and xs[1].failed.item() == 0
    assert results[0, 2, 0] == 1 and results[1, 2, 0] == 1  # one step: the serial bumped once
    assert results[0, 2, 1] == 2 and results[1, 2, 1] == 2
    epi0, ar0, epi1, ar1 = results[0, 0], results[0, 1], results[1, 0], results[1, 1]
    # both ranks bit-identical in every mode; a second step under the next tags the same bits; the allreduce path's
    # eager final norm to rounding
    assert torch.equal(epi0, epi1) and torch.equal(ar0, ar1)
    assert torch.equal(results[0, 3], epi0) and torch.equal(results[1, 3], epi0)
    assert float((epi0 - ar0).norm() / ar0.norm()) < (1e-6 if dtype == torch.float32 else 1e-2)
    with torch.inference_mode():
        tp1 = full.decode_step(torch.tensor([5]), torch.tensor([40]), 64, "fused")
    err = float((epi0 - tp1).norm() / tp1.norm())
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err
    assert int(epi0.argmax()) == int(tp1.argmax())


# ---- the in-graph lockstep in two kernels ---------------------------------------------------------------------

def test_the_two_kernel_lockstep_gives_what_the_torch_ops_give():
    import random

    from engine.core import lockstep

    rng = random.Random(5)
    for _ in range(40):
        h0 = rng.randrange(-(1 << 63), 1 << 63)
        tok, pos = rng.randrange(0, 200_000), rng.randrange(0, 1 << 17)
        flags = [rng.choice((0, 1)), rng.choice((0, 0, 1))]
        peer = torch.tensor([tok if rng.random() < 0.7 else tok + 1, rng.randrange(-(1 << 62), 1 << 62),
                             rng.choice((0, 1))])
        outs, states = [], []
        for kernels in (True, False):
            state = torch.tensor([h0])
            mine = {}

            def gather(msg):
                mine["msg"] = msg.clone()
                return (msg, peer.clone()) if rng_rank == 0 else (peer.clone(), msg)

            for rng_rank in (0, 1):
                state = torch.tensor([h0])
                out = lockstep.in_graph(torch.tensor(tok), torch.tensor([pos]), state, torch.tensor(flags), gather,
                                        kernels=kernels)
                outs.append(out.tolist())
                states.append(int(state))
        assert outs[0] == outs[2] and outs[1] == outs[3], (outs, flags)
        assert states[0] == states[2] == lockstep.hash_step_ref(h0, tok, pos, flags[1])
