"""Throttling under a sustained load on all cards at once (cards heat each other).

Load: per card, a thread alternating half-precision matrix products (8192^3: bf16 from
compute capability 8.0, fp16 below, where bf16 has no tensor cores) and a 512 MiB copy,
so both the SMs and the memory are busy. A sampler thread reads SM/memory clocks,
temperature, power and the clock-event reason bitmask through NVML at ``sample_hz``
(10 Hz by default). By hand: ``nvidia-smi dmon -s pc`` and ``nvidia-smi -q -d PERFORMANCE``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from probes import gpu, nvml
from probes.cases import Outcome, case, needs_cards
from probes.context import ProbeContext
from probes.throttle_summary import STEADY_TOLERANCE, STEADY_WINDOW_S, power_is_steady, summarise

MATMUL_N = 8192
COPY_BYTES = 512 * 2**20


def sample_once(handles: list[Any], t_s: float) -> list[dict[str, Any]]:
    q, c = nvml.query, nvml.const
    out = []
    for h in handles:
        out.append({
            "t_s": round(t_s, 3),
            "sm_mhz": q("nvmlDeviceGetClockInfo", h, c("NVML_CLOCK_SM", 1)).value,
            "mem_mhz": q("nvmlDeviceGetClockInfo", h, c("NVML_CLOCK_MEM", 2)).value,
            "temp_c": q("nvmlDeviceGetTemperature", h, c("NVML_TEMPERATURE_GPU", 0)).value,
            "power_w": q("nvmlDeviceGetPowerUsage", h, convert=lambda mw: round(mw / 1000, 1)).value,
            "reasons": _reasons(h),
        })
    return out


def _reasons(h: Any) -> int | None:
    r = nvml.query("nvmlDeviceGetCurrentClocksEventReasons", h)
    if not r.ok:  # older bindings name it "throttle reasons"
        r = nvml.query("nvmlDeviceGetCurrentClocksThrottleReasons", h)
    return r.value


def _load_torch(torch: Any, index: int, stop: threading.Event, errors: list[str], cc_major: int) -> None:
    try:
        dev = f"cuda:{index}"
        dtype = torch.bfloat16 if cc_major >= 8 else torch.float16
        a = torch.randn(MATMUL_N, MATMUL_N, device=dev, dtype=dtype)  # [N, N]
        b = torch.randn_like(a)
        x = torch.rand(COPY_BYTES // 4, device=dev)
        y = torch.empty_like(x)
        while not stop.is_set():
            for _ in range(8):
                a @ b
            y.copy_(x)
            torch.cuda.synchronize(dev)
    except Exception as e:  # noqa: BLE001 - reported by the case, the sampler keeps going
        errors.append(f"card {index}: load failed: {type(e).__name__}: {e}")


def run_load_and_sample(ctx: ProbeContext, torch: Any, duration_s: float, hz: float,
                        min_s: float | None = None) -> tuple[list, list, float]:
    """Load every card and sample for ``duration_s``; with ``min_s``, stop after at least that long once
    every card's power is steady (quick mode)."""
    handles = [nvml.query("nvmlDeviceGetHandleByIndex", card.index).value for card in ctx.cards]
    stop = threading.Event()
    errors: list[str] = []
    loads = []
    for card in ctx.cards:
        cc = card.values.get("compute_capability") or "0.0"
        t = threading.Thread(target=_load_torch, args=(torch, card.index, stop, errors, int(cc.split(".")[0])),
                             daemon=True)
        t.start()
        loads.append(t)
    per_card: list[list[dict[str, Any]]] = [[] for _ in ctx.cards]
    t0 = time.perf_counter()
    period = 1.0 / hz
    next_t = t0
    try:
        while (now := time.perf_counter()) - t0 < duration_s:
            for i, s in enumerate(sample_once(handles, now - t0)):
                per_card[i].append(s)
            if min_s is not None and now - t0 >= min_s and power_is_steady(per_card):
                break
            next_t += period
            time.sleep(max(0.0, next_t - time.perf_counter()))
    finally:
        stop.set()
        for t in loads:
            t.join(timeout=30)
    elapsed = time.perf_counter() - t0
    return per_card, errors, elapsed


def _applicable(ctx: ProbeContext) -> str | None:
    return needs_cards(ctx) or gpu.available("torch")


@case("throttle", "Clocks, temperature, power and clock-event reasons under a sustained load on all cards at once",
      order=60, timeout_s=lambda ctx: ctx.options.load_duration_s + 90, applicable=_applicable, needs=("inventory",))
def run_throttle(ctx: ProbeContext) -> Outcome:
    torch = gpu.torch()
    duration, hz, min_s = ctx.options.load_duration_s, ctx.options.sample_hz, ctx.options.min_load_s
    per_card, errors, elapsed = run_load_and_sample(ctx, torch, duration, hz, min_s)
    window = (f"for {elapsed:.1f} s (at least {min_s:g} s, then until every card's power held within "
              f"{STEADY_TOLERANCE:.0%} for {STEADY_WINDOW_S:g} s; at most {duration:g} s)" if min_s is not None
              else f"for {duration:.0f} s")
    ctx.method["throttle"] = (f"{MATMUL_N}^3 half-precision matmuls + {COPY_BYTES >> 20} MiB copies on every card "
                              f"{window}; NVML sampled at {hz:.0f} Hz; first 1 s left out")
    verdicts, worst = {}, "passed"
    for card, samples in zip(ctx.cards, per_card):
        v = card.values
        summary = summarise(samples, sm_clock_max_mhz=v.get("sm_clock_max_mhz"),
                            temp_slowdown_c=v.get("temp_slowdown_c"), power_limit_w=v.get("power_limit_w"),
                            duration_s=round(elapsed, 2), sample_hz=round(len(samples) / elapsed, 2),
                            keep_samples=ctx.options.keep_samples)
        card.set("throttle", summary)
        verdicts[card.index] = summary.explanation
        if summary.verdict == "thermally_limited":
            worst = "failed"
        elif summary.verdict == "power_capped" and worst == "passed":
            worst = "warned"
    if errors:
        return Outcome("failed" if len(errors) == len(ctx.cards) else "warned", "; ".join(errors), verdicts)
    reason = "; ".join(f"card {i}: {text}" for i, text in verdicts.items())
    return Outcome(worst, reason if worst != "passed" else None, verdicts)
