"""The device mailbox whose wait runs on the GPU, so a whole decode step with it can be captured
in a CUDA graph (the engine's device_mailbox waits by polling from the host, which a graph cannot hold).

Same exchange as engine/allreduce/device_mailbox.py: each rank writes its half straight into the peer's
inbox (CUDA IPC, peer-to-peer stores) and reads the peer's half from its own. Differences:
  - the step counter lives in device memory and is bumped by a kernel, so every graph replay uses the
    next step without the host;
  - each 8-byte inbox word is (step << 32 | 4 data bytes), written with one 64-bit store, so a reader that
    sees the step also sees that word's data;
  - the reader is a kernel: each thread spins (volatile loads) on its own words until their step matches,
    bounded by a %globaltimer deadline; a timeout sets a device flag that ``check()`` turns into an error.
Two slots alternate (step parity), as in the host and device mailboxes, for the same reason.
Kernels are compiled by cupy (NVRTC) on first use, before any graph capture.
"""

from __future__ import annotations

import torch

from engine.allreduce.base import Path, PathError, PathTimeout
from engine.allreduce.device_mailbox import _Buffer, exchange_inboxes

SOURCE = r"""
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// A wait gives up at its deadline, or once it has waited 100 us and an earlier wait already timed out:
// after one timeout the rest of a captured step (dozens of exchanges) ends in milliseconds, not in
// dozens of deadlines, so the host sees the failure one deadline after the peer stalled. A peer on time
// answers within microseconds, so the flag is never read on the fast path.
__device__ __forceinline__ bool gave_up(unsigned long long start, unsigned long long timeout_ns, int* failed) {
    unsigned long long waited = now_ns() - start;
    return waited > timeout_ns || (waited > 100000ull && *((volatile int*)failed) != 0);
}

// The exchange both kernels run: each thread sends its words to the peer, waits for the peer's same words
// and hands each pair to take(i, this rank's word, the peer's word) (a thread whose wait timed out takes
// no more); the last block to finish bumps the step counter (every block read it at its start, so none
// can see the new value).
template <typename Take>
__device__ __forceinline__ void exchange(const unsigned int* __restrict__ src, unsigned long long* peer_inbox,
                                         const unsigned long long* inbox, unsigned int* ctr, unsigned int* done,
                                         int words, int slot_words, unsigned long long timeout_ns, int* failed,
                                         Take take) {
    unsigned int step = ctr[0] + 1u;
    volatile unsigned long long* dst = peer_inbox + (size_t)(step & 1u) * slot_words;
    const volatile unsigned long long* box = inbox + (size_t)(step & 1u) * slot_words;
    int stride = gridDim.x * blockDim.x;
    int first = blockIdx.x * blockDim.x + threadIdx.x;
    for (int i = first; i < words; i += stride) dst[i] = ((unsigned long long)step << 32) | (unsigned long long)src[i];
    unsigned long long start = now_ns();
    bool ok = true;
    for (int i = first; ok && i < words; i += stride) {
        unsigned long long v = box[i];
        while ((unsigned int)(v >> 32) != step) {
            if (gave_up(start, timeout_ns, failed)) { atomicExch(failed, 1); ok = false; break; }
            v = box[i];
        }
        if (ok) take(i, src[i], (unsigned int)(v & 0xffffffffull));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(done, 1u) == gridDim.x - 1) { done[0] = 0u; ctr[0] = step; __threadfence(); }
    }
}

// The whole all_gather in ONE kernel: out is [rank 0's words | rank 1's words].
extern "C" __global__ void mbox_gather(const unsigned int* __restrict__ src, unsigned long long* peer_inbox,
                                       const unsigned long long* inbox, unsigned int* __restrict__ out,
                                       unsigned int* ctr, unsigned int* done, int words, int slot_words,
                                       int rank, unsigned long long timeout_ns, int* failed) {
    exchange(src, peer_inbox, inbox, ctr, done, words, slot_words, timeout_ns, failed,
             [=](int i, unsigned int mine, unsigned int peer) {
                 out[(size_t)rank * words + i] = mine;
                 out[(size_t)(1 - rank) * words + i] = peer;
             });
}

// 16-bit floats inside a 32-bit word, summed as torch sums them: in float32, rounded to nearest even.
__device__ __forceinline__ float bf16_to_f(unsigned int h) { return __uint_as_float(h << 16); }
__device__ __forceinline__ unsigned int f_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;  // NaN stays NaN (quiet)
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}
__device__ __forceinline__ float f16_to_f(unsigned int h) {
    float f; unsigned short s = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}
__device__ __forceinline__ unsigned int f_to_f16(float f) {
    unsigned short s;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(s) : "f"(f));
    return (unsigned int)s;
}
__device__ __forceinline__ unsigned int add_word(unsigned int a, unsigned int b, int dtype) {
    if (dtype == 0) return __float_as_uint(__uint_as_float(a) + __uint_as_float(b));
    if (dtype == 1) return f_to_bf16(bf16_to_f(a & 0xffffu) + bf16_to_f(b & 0xffffu))
                         | (f_to_bf16(bf16_to_f(a >> 16) + bf16_to_f(b >> 16)) << 16);
    return f_to_f16(f16_to_f(a & 0xffffu) + f16_to_f(b & 0xffffu))
         | (f_to_f16(f16_to_f(a >> 16) + f16_to_f(b >> 16)) << 16);
}

// The whole allreduce in ONE kernel: out is rank 0's words + rank 1's words.
extern "C" __global__ void mbox_allreduce(const unsigned int* __restrict__ src, unsigned long long* peer_inbox,
                                          const unsigned long long* inbox, unsigned int* __restrict__ out,
                                          unsigned int* ctr, unsigned int* done, int words, int slot_words,
                                          int rank, int dtype, unsigned long long timeout_ns, int* failed) {
    exchange(src, peer_inbox, inbox, ctr, done, words, slot_words, timeout_ns, failed,
             [=](int i, unsigned int mine, unsigned int peer) {
                 out[i] = rank == 0 ? add_word(mine, peer, dtype) : add_word(peer, mine, dtype);
             });
}
"""

EPILOGUE_WORDS = 8192
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_KERNELS: dict[int, tuple] = {}


def _kernels(device_index: int):
    import cupy as cp

    if device_index not in _KERNELS:
        with cp.cuda.Device(device_index):
            mod = cp.RawModule(code=SOURCE, options=("-std=c++17",))
            _KERNELS[device_index] = tuple(mod.get_function(n) for n in ("mbox_gather", "mbox_allreduce"))
    return _KERNELS[device_index]


class GraphMailbox(Path):
    name = "device_mailbox_graph"
    capturable = True  # send, wait and step bump are kernels: the decode step's graph holds them

    def __init__(self, rank, timeout_s, abort=None, *, device: torch.device, store, generation: int,
                 barrier, max_bytes: int = 8 << 20):
        # 8 MB: a 256-token prefill chunk of a hidden size up to 8192 in 16-bit (4 MB), with room to spare
        super().__init__(rank, timeout_s, abort)
        if device.type != "cuda":
            raise PathError("not applicable: the GPU-side mailbox needs CUDA devices")
        try:
            import cupy  # noqa: F401
        except ImportError:
            raise PathError("not applicable: the GPU-side mailbox compiles its kernels with cupy") from None
        self.device = device
        self.slot_words = max_bytes // 4
        # _Buffer gives int32 [2, words, 2] = two slots of `words` 8-byte words, zeroed, with an IPC handle.
        self.inbox = _Buffer(self.slot_words, device)
        self.peer_inbox = exchange_inboxes(self.inbox, f"device_mailbox_graph/g{generation}/r", rank, device,
                                           store, barrier)
        self.ctr = torch.zeros(1, dtype=torch.int32, device=device)
        self.failed = torch.zeros(1, dtype=torch.int32, device=device)
        self.timeout_ns = int(timeout_s * 1e9)
        # The decode step's exchange inside the GEMVs (engine.allreduce.epilogue): two slots of 8192 words,
        # a row of up to 16384 16-bit values (8192 float32), 128 KB.
        self.xs_inbox = _Buffer(EPILOGUE_WORDS, device)
        self.xs_peer_inbox = exchange_inboxes(self.xs_inbox, f"device_mailbox_graph/g{generation}/x", rank, device,
                                              store, barrier)
        self._xs = None
        self.done = torch.zeros(1, dtype=torch.int32, device=device)
        self.gather, self.fused = _kernels(device.index)

    def _run(self, fn, words: torch.Tensor, out_words: int, *extra) -> torch.Tensor:
        """One exchange kernel over ``words`` (int32 [w]; send, wait, combine, step bump) into a new int32
        [out_words]; ``extra`` are the kernel's arguments between rank and the timeout (allreduce's dtype)."""
        import cupy as cp
        import numpy as np

        w = words.numel()
        if w > self.slot_words:
            raise PathError(f"message of {w * 4} bytes exceeds the mailbox's {self.slot_words * 4}")
        out = torch.empty(out_words, dtype=torch.int32, device=self.device)
        block = 256
        grid = max(1, min(-(-w // block), 264))  # grid-stride; a block sends before it waits: no deadlock
        p = np.uint64
        args = (p(words.data_ptr()), p(self.peer_inbox.data_ptr()), p(self.inbox.tensor.data_ptr()),
                p(out.data_ptr()), p(self.ctr.data_ptr()), p(self.done.data_ptr()), np.int32(w),
                np.int32(self.slot_words), np.int32(self.rank), *(np.int32(e) for e in extra),
                p(self.timeout_ns), p(self.failed.data_ptr()))
        stream = cp.cuda.ExternalStream(torch.cuda.current_stream(self.device).cuda_stream, self.device.index)
        with stream:
            fn((grid,), (block,), args)
        return out

    def _gather_words(self, x) -> tuple[torch.Tensor, int]:
        """[rank 0's bytes | rank 1's bytes] of x (one kernel: send, wait, copy, step bump), and x's byte count."""
        raw = x.detach().contiguous().view(-1).view(torch.uint8)  # [nbytes]
        n = raw.numel()
        if n % 4:
            raise PathError(f"the GPU-side mailbox moves whole 4-byte words; got {n} bytes")
        out = self._run(self.gather, raw.view(torch.int32), 2 * (n // 4))
        return out.view(torch.uint8), n

    def all_gather(self, x):
        both, n = self._gather_words(x)
        a = both[:n].view(x.dtype).view(x.shape)
        b = both[n:].view(x.dtype).view(x.shape)
        return a, b

    def gather_last(self, x):
        """[rank 0's x | rank 1's x] along the last dimension; for one row (the decode step's logits) the kernel's
        output is that concatenation already (no copy)."""
        if x.numel() != x.shape[-1]:
            return super().gather_last(x)
        both, _ = self._gather_words(x)
        return both.view(x.dtype).view(*x.shape[:-1], 2 * x.shape[-1])

    def allreduce_sum(self, x):
        """rank 0's x + rank 1's x in one kernel (send, wait, add, step bump) for float32 / bf16 / fp16;
        bit-identical to torch's ``a + b`` (the self-test checks it), so both ranks hold the same sum."""
        code = DTYPE_CODE.get(x.dtype)
        raw = x.detach().contiguous().view(-1).view(torch.uint8)  # [nbytes]
        n = raw.numel()
        if code is None or n % 4:
            return super().allreduce_sum(x)
        out = self._run(self.fused, raw.view(torch.int32), n // 4, code)
        return out.view(torch.uint8)[:n].view(x.dtype).view(x.shape)

    def epilogue(self):
        """This rank's side of the exchange inside the decode step's GEMVs (shares ``failed`` with the
        mailbox, so check() reports its timeouts too)."""
        from engine.allreduce.epilogue import EpilogueExchange

        if self._xs is None:
            words = EPILOGUE_WORDS
            self._xs = EpilogueExchange(inbox=self.xs_inbox.tensor.view(torch.int64).view(2, words),
                                        peer_inbox=self.xs_peer_inbox.view(torch.int64).view(2, words),
                                        rank=self.rank, timeout_ns=self.timeout_ns, failed=self.failed)
        return self._xs

    def check(self) -> None:
        """Raise if any wait since the start timed out (call outside graph capture)."""
        if int(self.failed.item()):
            raise PathTimeout(f"device_mailbox_graph: a wait passed {self.timeout_ns / 1e9} s on the GPU "
                              "(peer stalled or gone)")
