"""The in-graph lockstep's two kernels around the ranks' exchange (engine.core.lockstep.in_graph launches them; its
torch form is the reference): ``pre`` mixes the step's token and position into the running hash and writes this
rank's message [token, hash, cancel]; ``post`` compares the two ranks' messages -> [token, agree, cancel, token0,
hash0, token1, hash1]."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pre(tok_ptr, pos_ptr, state_ptr, flags_ptr, msg_ptr, MIX_T: tl.constexpr, MIX_P: tl.constexpr):
    t = tl.load(tok_ptr).to(tl.int64)
    h = ((tl.load(state_ptr) ^ t) * MIX_T) ^ (tl.load(pos_ptr) * MIX_P) ^ tl.load(flags_ptr + 1)
    tl.store(state_ptr, h)
    tl.store(msg_ptr, t)
    tl.store(msg_ptr + 1, h)
    tl.store(msg_ptr + 2, tl.load(flags_ptr))


@triton.jit
def post(msg_ptr, a_ptr, b_ptr, out_ptr):
    a0, a1, a2 = tl.load(a_ptr), tl.load(a_ptr + 1), tl.load(a_ptr + 2)
    b0, b1, b2 = tl.load(b_ptr), tl.load(b_ptr + 1), tl.load(b_ptr + 2)
    tl.store(out_ptr, tl.load(msg_ptr))
    tl.store(out_ptr + 1, ((a0 == b0) & (a1 == b1)).to(tl.int64))
    tl.store(out_ptr + 2, a2 | b2)
    tl.store(out_ptr + 3, a0)
    tl.store(out_ptr + 4, a1)
    tl.store(out_ptr + 5, b0)
    tl.store(out_ptr + 6, b1)
