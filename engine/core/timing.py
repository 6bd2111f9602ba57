"""Timing helpers every bench and the start-up race use: CUDA-graph capture and replay timing between
CUDA events, and synchronised eager timing. Medians, never means (one slow replay must not move them)."""

from __future__ import annotations

import statistics
import time

import torch


def capture(fn, device: torch.device | None = None, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph after ``warmup`` calls on a side stream. With an allreduce inside,
    both ranks call this in step: their warm-up exchanges pair up."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_graph_ms(graph, n: int = 50, batches: int = 5) -> float:
    """Median milliseconds per replay: ``batches`` batches of ``n`` replays between CUDA events."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    res = []
    for _ in range(batches):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            graph.replay()
        e.record()
        e.synchronize()
        res.append(s.elapsed_time(e) / n)
    return statistics.median(res)


def graph_us(fn, device: torch.device | None, ops: int, n: int = 20) -> float:
    """``ops`` calls of fn captured in one graph: median microseconds per call."""
    def many():
        for _ in range(ops):
            fn()

    g = capture(many, device)
    us = time_graph_ms(g, n=n) * 1e3 / ops
    del g
    return us


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eager_us(fn, device: torch.device, iters: int, warmup: int = 10) -> float:
    """Median microseconds of fn(), synchronised before and after each call (host wall time)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def read_bandwidth_gbps(device: torch.device, nbytes: int | None = None, iters: int = 20) -> float:
    """The device's measured read bandwidth (GB/s): median time of a sum over a float32 buffer far
    beyond the caches (default 4 GiB on a GPU, 128 MiB on a CPU: a start-up's worth of time)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = nbytes or ((4 << 30) if cuda else (128 << 20))
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    for _ in range(2):
        x.sum()
    sync(device)
    ts = []
    for _ in range(iters):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            x.sum()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) * 1e-3)
        else:
            t0 = time.perf_counter()
            x.sum()
            ts.append(time.perf_counter() - t0)
    del x
    return nbytes / statistics.median(ts) / 1e9
