"""The batched decode step of ``serve --max-concurrency N`` as CUDA graphs, one per (row bucket, window).

Model.decode_batch is tens of small torch kernels per layer, each launched from Python when run eagerly; the
concurrency bench timed it as one graph per C (docs/engine-speed.md, 2026-12-06), which is not how the service
ran it. Where the rank's Decoder runs graphs (a CUDA card, and a capturable allreduce path at TP2), the batch loop
replays captured steps instead (how much that saves over the eager launches is what the bench's eager_ms is for):

  rows     buckets 1, 2, 4, 8, ... up to N (N itself the last): B running sequences take the smallest bucket that
           holds them; the rows past B repeat row 0 (its token, position, slot and rotary position), so they compute
           and write exactly what row 0 writes, into row 0's own slot, and no other slot is touched. Their logits
           are dropped: a padded row costs time, never a token.
  windows  the Decoder's attention windows (256, 512, ... up to the context limit): a step takes the smallest
           window past every row's position, as the one-sequence graphs do.

Static inputs (token, position, slot, rotary position; N rows each) are filled before each replay; the logits
come out of one shared [N, V] buffer, copied out for the caller. Captured at start-up by both ranks in the same
order (the allreduces of their warm-up steps pair up), before ``ready``. The warm-up steps run rows at position 0 of
slots 0..r-1; every slot is zeroed afterwards, so no request sees them. A (rows, window) whose warm-up runs out of
memory is not captured at TP1: that shape, and every larger window for as many rows or more, runs eagerly (the
reason is in ``info``); with a peer rank it ends the capture (the two ranks could disagree on what to skip, and
their warm-up allreduces must pair up), and the loop runs every step eagerly. Without graphs (CPU, a path that
waits on the host) the loop calls decode_batch directly.

On unless ``serve --no-batch-graphs``: its GPU check (tests/engine/test_engine_batch_graphs_gpu.py: replays equal
the padded eager step bit for bit) passed on an H100 (2026-12-06, docs/concurrency_run.sh), where the graphs took the
27B's batched step from 33.3 ms launched eagerly to 22.7 ms at C = 1 (27.7 to 25.3 ms at C = 8,
docs/engine-speed.md); the padding and the buffers are checked on CPU (tests/engine/test_engine_batch_graphs.py).
"""

from __future__ import annotations

import time

import torch


def row_buckets(n: int) -> list[int]:
    """1, 2, 4, ... below n, then n."""
    out, r = [], 1
    while r < n:
        out.append(r)
        r *= 2
    return out + [n]


def bucket(b: int, sizes: list[int]) -> int | None:
    """The smallest size holding b (None: none does)."""
    return next((s for s in sizes if s >= b), None)


def padded(values: list[int], r: int) -> list[int]:
    """``values`` (B of them) to r rows, the rows past B repeating row 0."""
    return values + [values[0]] * (r - len(values))


class BatchGraphs:
    """``step(toks, pos, slots, rope)`` (host lists of B ints each) -> float32 logits [B, V]: the batched step of
    those rows, replayed from the graph of its (row bucket, window), or eagerly for a shape that has none. Before
    capture() (or on CPU, where it is never called) every shape runs eagerly through the same static buffers,
    padding and windows (what the CPU tests drive)."""

    def __init__(self, model, n: int, windows: list[int]):
        self.model, self.n, self.windows = model, n, list(windows)
        self.rows = row_buckets(n)
        dev = model.device
        self.toks = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.rope = torch.zeros(n, dtype=torch.long, device=dev)
        self.out: torch.Tensor | None = None  # [n, V] float32, written by every graph
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.info: dict = {"rows": self.rows, "windows": self.windows, "graphs": 0, "capture_s": None,
                           "eager_shapes": None}
        self.replays = self.eager_steps = 0

    def window_for(self, pos: int) -> int:
        for w in self.windows:
            if pos < w:
                return w
        raise ValueError(f"position {pos} is past the context limit {self.windows[-1]}")

    def _run(self, r: int, w: int) -> torch.Tensor:
        """The step over the static buffers' first r rows at window w (what a graph captures)."""
        return self.model.decode_batch(self.toks[:r], self.pos[:r], self.slots[:r], w, self.rope[:r])

    @torch.inference_mode()
    def capture(self) -> dict:
        """One graph per (row bucket, window), all in one memory pool, the smaller shapes first."""
        dev = self.model.device
        t0 = time.perf_counter()
        pool, skipped = None, []
        vocab = self.model.cfg.vocab_size
        self.out = torch.zeros(self.n, vocab, dtype=torch.float32, device=dev)
        too_big: dict[int, int] = {}  # rows -> the first window whose warm-up ran out of memory
        for r in self.rows:
            self.slots[:r].copy_(torch.arange(r, device=dev))
            for buf in (self.toks, self.pos, self.rope):
                buf.zero_()
            for w in self.windows:
                if any(rr <= r and w >= ww for rr, ww in too_big.items()):
                    skipped.append([r, w])
                    continue
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                try:
                    with torch.cuda.stream(side):
                        for _ in range(2):  # compiles, cuBLAS workspaces, NCCL set-up; sizes the pool
                            self._run(r, w)
                    torch.cuda.current_stream(dev).wait_stream(side)
                except torch.OutOfMemoryError:
                    if self.model.comm is not None:
                        raise
                    torch.cuda.current_stream(dev).wait_stream(side)
                    torch.cuda.synchronize(dev)
                    torch.cuda.empty_cache()
                    too_big[r] = w
                    skipped.append([r, w])
                    continue
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.out[:r].copy_(self._run(r, w))
                pool = g.pool()
                self._graphs[(r, w)] = g
        torch.cuda.synchronize(dev)
        self.forget_warm_up()
        self.info.update(graphs=len(self._graphs), capture_s=round(time.perf_counter() - t0, 2),
                         eager_shapes=skipped or None)
        if skipped:
            self.info["eager_why"] = ("the warm-up step of these [rows, window] shapes (and larger) ran out of "
                                      "memory: they run eagerly")
        return self.info

    def forget_warm_up(self) -> None:
        """Every slot zeroed (the warm-up steps wrote position 0 of slots 0..r-1), the one-sequence prefix cache
        told (its snapshots are of slot 0)."""
        for s in range(self.model.slots):
            self.model.reset_slot(s)
        if getattr(self.model, "prefix", None) is not None:
            self.model.prefix.forget()

    @torch.inference_mode()
    def load(self, toks: list[int], pos: list[int], slots: list[int], rope: list[int]) -> tuple[int, int]:
        """The rows into the static buffers, padded to their bucket: (rows bucket, window)."""
        b = len(toks)
        r = bucket(b, self.rows)
        if r is None:
            raise ValueError(f"{b} rows: at most {self.n} sequences decode together")
        w = self.window_for(max(pos))
        for buf, vals in ((self.toks, toks), (self.pos, pos), (self.slots, slots), (self.rope, rope)):
            buf[:r].copy_(torch.tensor(padded(vals, r), dtype=torch.long))
        return r, w

    def graph(self, r: int, w: int) -> torch.cuda.CUDAGraph | None:
        """The captured step of r rows at window w (None: that shape runs eagerly); the bench times it."""
        return self._graphs.get((r, w))

    @torch.inference_mode()
    def step(self, toks: list[int], pos: list[int], slots: list[int], rope: list[int]) -> torch.Tensor:
        b = len(toks)
        r, w = self.load(toks, pos, slots, rope)
        g = self._graphs.get((r, w))
        if g is None:
            self.eager_steps += 1
            return self._run(r, w)[:b].clone()
        self.replays += 1
        g.replay()
        return self.out[:b].clone()


def for_rank(model, decoder, n: int, enabled: bool = True) -> tuple[BatchGraphs | None, dict]:
    """(the batch loop's graphs, what /health says of them): captured now when ``enabled`` (unless serve
    --no-batch-graphs), N > 1 and the rank's decoder runs graphs; else None (the loop calls decode_batch eagerly),
    with the reason."""
    if n < 2:
        return None, {"mode": "none", "why": "one sequence at a time (the Decoder's graphs)"}
    if not enabled:
        return None, {"mode": "eager", "why": "serve --no-batch-graphs"}
    if not getattr(decoder, "graphs", False):
        return None, {"mode": "eager", "why": "the decoder runs no graphs here (CPU, or an allreduce path that "
                                              "waits on the host)"}
    graphs = BatchGraphs(model, n, decoder.windows)
    try:
        graphs.capture()
    except RuntimeError as e:  # the step runs eagerly, correct and slower; the reason is shown
        torch.cuda.synchronize(model.device)
        graphs.forget_warm_up()
        return None, {"mode": "eager", "why": f"capturing the batched step failed: {type(e).__name__}: {e}"}
    return graphs, {"mode": "graphs", **graphs.info}
