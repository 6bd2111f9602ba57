"""The TP2 exchange's device side (engine.kernels.exchange holds the buffers, tickets and launches): the Triton device
functions that tag, send and wait for the 8-byte words (engine.allreduce.epilogue describes the protocol), which the
sending GEMVs call (engine.kernels.gemv_jit, engine.kernels.gemv_int4_jit), and the kernel that receives an exchange
in a kernel of its own (exchange mode "send") or finishes the step's last one."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.rounding_jit import normed, rnd


@triton.jit
def xs_tag(ser_ptr, e):
    """The tag of exchange e of this step: the step serial and e (tagged 8-byte words, EPW values per word)."""
    s = tl.load(ser_ptr).to(tl.int64)
    return (((s & 0x3FFFFF) + 1) << 8) + e


@triton.jit
def xs_send(yd, pid, rows, rmask, N, xs_peer, xs_ser, xs_slot, xs_e, BLOCK_N: tl.constexpr, EPW: tl.constexpr):
    """A GEMV's output rows yd (this program's BLOCK_N), tagged, into the peer's inbox: one 64-bit store per
    word of EPW values."""
    stag = xs_tag(xs_ser, xs_e)
    if EPW == 2:
        u = tl.reshape(yd.to(tl.uint16, bitcast=True).to(tl.int64), (BLOCK_N // 2, 2))
        lo, hi = tl.split(u)
        words = lo | (hi << 16)
        widx = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        wmask = widx < N // 2
    else:
        words = yd.to(tl.uint32, bitcast=True).to(tl.int64)
        widx = rows
        wmask = rmask
    tl.store(xs_peer + xs_slot + widx, (stag << 32) | words, mask=wmask)


@triton.jit
def xs_wait(ptrs, mask, tag, failed_ptr, timeout_ns, INTERP: tl.constexpr):
    """The words at ptrs once all carry ``tag`` (volatile loads), or whatever is there when the deadline
    passed (then ``failed`` is set; after another wait's timeout, give up after 100 us)."""
    v = tl.load(ptrs, mask=mask, other=0, volatile=True)
    missing = tl.sum(tl.where(mask & ((v >> 32) != tag), 1, 0), axis=0)
    if INTERP:
        spins = 0
    else:
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                       pack=1)
    while missing > 0:
        v = tl.load(ptrs, mask=mask, other=0, volatile=True)
        missing = tl.sum(tl.where(mask & ((v >> 32) != tag), 1, 0), axis=0)
        if INTERP:  # the interpreter has no clock: one microsecond per spin
            spins += 1
            waited = spins * 1000
        else:
            waited = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                               is_pure=False, pack=1) - t0
        if missing > 0:
            if (waited > timeout_ns) | ((waited > 100000) & (tl.load(failed_ptr, volatile=True) != 0)):
                tl.atomic_xchg(failed_ptr, 1)
                missing = 0
    return v


@triton.jit
def xs_values(words, idx, EPW: tl.constexpr, dt: tl.constexpr):
    """float32 values of elements idx from their tagged words."""
    data = words & 0xFFFFFFFF
    if EPW == 2:
        h = (data >> ((idx % 2) * 16).to(tl.int64)) & 0xFFFF
        return h.to(tl.uint16).to(dt, bitcast=True).to(tl.float32)
    else:
        return data.to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def exchange_finish_kernel(own_ptr, out_ptr, xs_inbox, xs_ser, xs_failed, xs_slot, xs_e, xs_timeout, N,
                           BLOCK: tl.constexpr, EPW: tl.constexpr, EMU: tl.constexpr, INTERP: tl.constexpr,
                           BUMP: tl.constexpr, x_ptr=None, nw_ptr=None, eps=0.0, NORM: tl.constexpr = False,
                           ZC: tl.constexpr = False):
    # this rank's partial + the peer's (sent by its GEMV's epilogue), BLOCK values per program; BUMP (one
    # program: the step's last exchange) then bumps the step serial. NORM (one program, the whole row in one
    # block): out = RMSNorm(x + the sum) * nw instead, the model's final norm (Hugging Face's rounding)
    dt = own_ptr.dtype.element_ty
    tag = xs_tag(xs_ser, xs_e)
    offs = tl.arange(0, BLOCK)
    for k0 in range(tl.program_id(0) * BLOCK, N, BLOCK * tl.num_programs(0)):
        m = (k0 + offs) < N
        pw = xs_wait(xs_inbox + xs_slot + (k0 + offs) // EPW, m, tag, xs_failed, xs_timeout, INTERP)
        ov = tl.load(own_ptr + k0 + offs, mask=m, other=0.0).to(tl.float32)
        d = rnd(ov + xs_values(pw, k0 + offs, EPW, dt), dt, EMU)
        if NORM:
            xv = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
            r = rnd(xv + d.to(tl.float32), dt, EMU).to(tl.float32)
            rs = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / N + eps)
            nw = tl.load(nw_ptr + offs, mask=m, other=0.0).to(tl.float32)
            d = normed(r, rs, nw, dt, EMU, ZC)
        tl.store(out_ptr + k0 + offs, d, mask=m)
    if BUMP:
        s = tl.load(xs_ser)
        tl.store(xs_ser, s + 1)
