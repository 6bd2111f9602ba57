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
