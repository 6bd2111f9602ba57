"""Sustained memory bandwidth per card: a read kernel and a copy kernel (cupy RawKernel),
against in-run references (torch copy and torch sum, or cupy's when torch is absent).

Method: a 2 GiB float32 buffer of random data (far larger than any L2; capped at a
quarter of free memory), 16-byte loads in a grid-stride loop, the grid tuned over
multiples of the SM count, warm-up calls, then the median of many runs timed with
device events. Read GB/s counts bytes read; copy GB/s counts bytes read plus bytes
written. By hand: ``nvidia-smi -q -d CLOCK`` (Max Clocks, Memory) gives the clock the
implied figure uses: max memory clock x 2 (double data rate) x bus width / 8.
"""

from __future__ import annotations

from typing import Any

from probes import gpu
from probes.cases import Outcome, case, needs_cards
from probes.context import CardState, ProbeContext

_KERNELS = r"""
extern "C" __global__ void read_f4(const float4* __restrict__ a, float* __restrict__ partial, long long n) {
    // Four independent loads in flight per thread per iteration keep the memory system busy.
    float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f, acc3 = 0.f;
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        float4 v0 = __ldg(a + i), v1 = __ldg(a + i + stride);
        float4 v2 = __ldg(a + i + 2 * stride), v3 = __ldg(a + i + 3 * stride);
        acc0 += v0.x + v0.y + v0.z + v0.w; acc1 += v1.x + v1.y + v1.z + v1.w;
        acc2 += v2.x + v2.y + v2.z + v2.w; acc3 += v3.x + v3.y + v3.z + v3.w;
    }
    for (; i < n; i += stride) { float4 v = __ldg(a + i); acc0 += v.x + v.y + v.z + v.w; }
    float acc = (acc0 + acc1) + (acc2 + acc3);
    // Block sum so the result is checkable (and the loads cannot be optimised away).
    __shared__ float s[1024];
    s[threadIdx.x] = acc;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) s[threadIdx.x] += s[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

extern "C" __global__ void copy_f4(const float4* __restrict__ a, float4* __restrict__ b, long long n) {
    // Four loads in flight before the four stores, as in the read kernel (one at a time reached
    // 3.99 TB/s on the H200 against torch's 4.22).
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        float4 v0 = __ldg(a + i), v1 = __ldg(a + i + stride);
        float4 v2 = __ldg(a + i + 2 * stride), v3 = __ldg(a + i + 3 * stride);
        b[i] = v0; b[i + stride] = v1; b[i + 2 * stride] = v2; b[i + 3 * stride] = v3;
    }
    for (; i < n; i += stride) b[i] = __ldg(a + i);
}
"""

BUFFER_BYTES = 2 * 2**30
BLOCK = 512
GRID_FACTORS = (4, 8, 16, 32)


def _runs(ctx: ProbeContext) -> tuple[int, int]:
    """(warm-up, timed runs): quick mode trades a little spread for time."""
    return (3, 20) if ctx.options.mode == "quick" else (5, 50)


def measure_card(cp: Any, torch: Any | None, index: int, warmup: int, runs: int) -> dict[str, Any]:
    """Read and copy bandwidth on device ``index`` with the tuned launch shape and references."""
    try:
        return _measure(cp, torch, index, warmup, runs)
    finally:
        # Hand the buffers back so the throttle load that follows has the memory.
        with cp.cuda.Device(index):
            cp.get_default_memory_pool().free_all_blocks()


def _measure(cp: Any, torch: Any | None, index: int, warmup: int, runs: int) -> dict[str, Any]:
    with cp.cuda.Device(index):
        props = cp.cuda.runtime.getDeviceProperties(index)
        sms = int(props["multiProcessorCount"])
        l2_bytes = int(props.get("l2CacheSize", 0))
        free, _total = cp.cuda.runtime.memGetInfo()
        nbytes = min(BUFFER_BYTES, (free // 4) // 16 * 16)
        n = nbytes // 4  # floats
        n4 = n // 4  # float4s
        module = cp.RawModule(code=_KERNELS)
        read_k, copy_k = module.get_function("read_f4"), module.get_function("copy_f4")
        a = cp.random.random(n, dtype=cp.float32)  # random data, never zeros
        b = cp.empty_like(a)
        partial = cp.empty(sms * max(GRID_FACTORS), dtype=cp.float32)
        ev = lambda: (cp.cuda.Event(), cp.cuda.Event())  # noqa: E731
        el = cp.cuda.get_elapsed_time

        # Tune the grid on a few runs each, then time the best one properly.
        tuning = {}
        for f in GRID_FACTORS:
            grid = sms * f
            t = gpu.time_events_ms(lambda g=grid: read_k((g,), (BLOCK,), (a, partial, cp.int64(n4))), ev, el, 2, 5)
            tuning[grid] = round(nbytes / (gpu.median(t) * 1e-3) / 1e9, 1)
        grid = max(tuning, key=tuning.get)
        read_ms = gpu.time_events_ms(lambda: read_k((grid,), (BLOCK,), (a, partial, cp.int64(n4))), ev, el,
                                     warmup, runs)
        # Correct first: the blocks' partial sums must add up to the whole buffer's sum.
        got = float(partial[:grid].astype(cp.float64).sum())
        want = float(a.astype(cp.float64).sum())
        read_rel_err = abs(got - want) / abs(want)
        copy_tuning = {}
        for f in GRID_FACTORS:
            g = sms * f
            t = gpu.time_events_ms(lambda g=g: copy_k((g,), (BLOCK,), (a, b, cp.int64(n4))), ev, el, 2, 5)
            copy_tuning[g] = round(2 * nbytes / (gpu.median(t) * 1e-3) / 1e9, 1)
        copy_grid = max(copy_tuning, key=copy_tuning.get)
        b.fill(-1.0)  # poison, so a skipped element shows
        copy_ms = gpu.time_events_ms(lambda: copy_k((copy_grid,), (BLOCK,), (a, b, cp.int64(n4))), ev, el,
                                     warmup, runs)
        copy_exact = bool((b == a).all())

        references: dict[str, float] = {}
        if torch is not None:
            x = torch.as_tensor(a, device=f"cuda:{index}")  # shares cupy's memory
            y = torch.empty_like(x)
            tev = lambda: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))  # noqa: E731
            tel = lambda s, e: s.elapsed_time(e)  # noqa: E731
            with torch.cuda.device(index):
                t = gpu.time_events_ms(lambda: y.copy_(x), tev, tel, warmup, runs)
                references["torch_copy_gbps"] = round(2 * nbytes / (gpu.median(t) * 1e-3) / 1e9, 1)
                t = gpu.time_events_ms(lambda: x.sum(), tev, tel, warmup, runs)
                references["torch_sum_gbps"] = round(nbytes / (gpu.median(t) * 1e-3) / 1e9, 1)
            del x, y
            torch.cuda.empty_cache()
        else:
            t = gpu.time_events_ms(lambda: cp.copyto(b, a), ev, el, warmup, runs)
            references["cupy_copy_gbps"] = round(2 * nbytes / (gpu.median(t) * 1e-3) / 1e9, 1)
            t = gpu.time_events_ms(lambda: a.sum(), ev, el, warmup, runs)
            references["cupy_sum_gbps"] = round(nbytes / (gpu.median(t) * 1e-3) / 1e9, 1)

    read_gbps = nbytes / (gpu.median(read_ms) * 1e-3) / 1e9
    copy_gbps = 2 * nbytes / (gpu.median(copy_ms) * 1e-3) / 1e9
    best_ref = max(references.values())
    return {
        "sm_count": sms,
        "l2_cache_mib": round(l2_bytes / 2**20, 1),
        "read_bw_gbps": round(read_gbps, 1),
        "copy_bw_gbps": round(copy_gbps, 1),
        "bandwidth": {
            "method": f"cupy RawKernel, float4 grid-stride, {BLOCK} threads a block, grid tuned over "
                      f"SMs x {list(GRID_FACTORS)}, {warmup} warm-up, median of {runs} event-timed runs",
            "buffer_bytes": nbytes,
            "buffer_over_l2": round(nbytes / l2_bytes, 1) if l2_bytes else None,
            "read_grid": grid, "copy_grid": copy_grid, "block": BLOCK,
            "read_tuning_gbps": {str(k): v for k, v in tuning.items()},
            "copy_tuning_gbps": {str(k): v for k, v in copy_tuning.items()},
            "read_ms_runs": [round(x, 4) for x in read_ms],
            "copy_ms_runs": [round(x, 4) for x in copy_ms],
            "read_check_rel_err": read_rel_err,
            "copy_check_exact": copy_exact,
            "references_gbps": references,
            "read_over_best_reference": round(read_gbps / best_ref, 4),
        },
    }


def _applicable(ctx: ProbeContext) -> str | None:
    return needs_cards(ctx) or gpu.available("cupy")


def _store(card: CardState, got: dict[str, Any]) -> None:
    for k in ("sm_count", "l2_cache_mib", "read_bw_gbps", "copy_bw_gbps", "bandwidth"):
        card.set(k, got[k])


@case("bandwidth", "Sustained read and copy bandwidth per card, against torch copy/sum measured in the same run",
      order=30, timeout_s=180, applicable=_applicable)
def run_bandwidth(ctx: ProbeContext) -> Outcome:
    cp = gpu.cupy()
    try:
        torch = gpu.torch()
    except gpu.Missing:
        torch = None
    warmup, runs = _runs(ctx)
    problems, summary = [], {}
    for card in ctx.cards:
        got = measure_card(cp, torch, card.index, warmup, runs)
        _store(card, got)
        bw = got["bandwidth"]
        summary[card.index] = {"read_bw_gbps": got["read_bw_gbps"], "copy_bw_gbps": got["copy_bw_gbps"],
                               **bw["references_gbps"]}
        if bw["read_check_rel_err"] > 1e-3:
            problems.append(f"card {card.index}: read kernel sum off by {bw['read_check_rel_err']:.2e}")
        if not bw["copy_check_exact"]:
            problems.append(f"card {card.index}: copy kernel output differs from its input")
    ctx.method["bandwidth"] = got["bandwidth"]["method"]
    if problems:
        return Outcome("failed", "; ".join(problems), summary)
    return Outcome("passed", None, summary)
