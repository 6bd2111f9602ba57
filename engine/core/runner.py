"""One request's loop, shared by a single process (TP1) and each rank (TP2): chunked prefill, then one
token per step through the Decoder. Hooks see every chunk and every token before it is handed out and
may stop the request.

The Decoder runs Model.decode_step, the one decode step, in the fastest way this device and allreduce
path allow, and says which and why (``Decoder.info``). It resolves one engine.core.decode_mode.DecodeMode when it
is built (graphs, kernels, exchange, lockstep: its arguments, else the environment, read then and never during a
step) and passes it into every step, capture and exchange:
  graphs   CUDA: one graph per context bucket (window = 256, 512, 1024, ... up to the context limit),
           captured at start-up over the static K/V cache, with the allreduce inside when the path can
           be captured (nccl, device_mailbox_graph); else (CPU, a path that waits on the host) eager.
  kernels  "fused": five Triton kernels per layer (engine.kernels.decode: norm + QKV GEMV, one kernel for
           q/k norm, RoPE, the cache write and the attention, o_proj GEMV, norm + gate/up GEMV, SiLU + down
           GEMV) where Triton targets the card; "eager" (by request, or without Triton): the plain blocks. The V100 (7.0, fp16) runs "fused" where a ptxas still targets sm_70 (engine.core.sm70),
           else the plain blocks; CPUs run the plain blocks. The prefill takes the same choice for this device
           (``device_kernels``, Model.kernels): "fused" runs the Gated DeltaNet layers' chunked rule as
           engine.kernels.gdn_chunk's two kernels, anything else as engine.kernels.gdn.chunked.
  exchange (TP2) where the layers' partial outputs meet (engine.allreduce.epilogue): "send" where the fused blocks
           and the device mailbox take it, else "kernel" (the path's allreduce); V100PLAN_ENGINE_EXCHANGE overrides.
  lockstep (TP2) inside the step's graph (two Triton kernels from compute capability 8.0, else torch ops), or
           after each step without graphs.
  int4_pdl packed (int4) weights: the GEMV launched while its row kernel runs where the card has it (engine.kernels.
           gemv_int4.use_pdl, set here); V100PLAN_ENGINE_INT4_PDL=0 turns it off.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

# the choices themselves live in engine.core.decode_mode (kernel_choice is also read from here)
from engine import dtype_rule, tuning
from engine.core import decode_mode
from engine.core.decode_mode import DecodeMode, kernel_choice  # noqa: F401
from engine.core.device import device_kernels, sm70_ptxas, triton_ok  # noqa: F401 (device_kernels re-exported)
from engine.core.model import Model
from engine.core.sampling import Sampler
from engine.kernels import gemv_int4

# (phase, index within the phase, tokens of this step, position after it) -> True to cancel
StepHook = Callable[[str, int, list[int], int], bool]

FIRST_BUCKET = 256
SNAPSHOT_EVERY = 8192  # prefill positions between the prefix cache's snapshots of a long prompt
def dtype_for(device_type: str, capability: tuple[int, int] | None) -> str:
    """engine.dtype_rule for this device type and capability."""
    return dtype_rule.dtype_for(capability if device_type == "cuda" else dtype_rule.CPU)


def buckets(max_context: int, first: int = FIRST_BUCKET) -> list[int]:
    """Attention windows with one graph each: doubling from ``first``, the last one the context limit."""
    out, w = [], first
    while w < max_context:
        out.append(w)
        w *= 2
    out.append(max_context)
    return out


class Decoder:
    """The decode step as everything serves it. ``logits(tok, pos)`` -> float32 logits [V] of the
    token ``tok`` at position ``pos`` (its K/V written into the cache)."""

    def __init__(self, model: Model, *, graphs: bool | None = None, kernels: str | None = None,
                 exchange: str | None = None, bucket_list: list[int] | None = None, int4_pdl: bool | None = None):
        self.model = model
        dev = model.device
        comm = model.comm
        path = getattr(comm, "path", None)
        self.mode = self._resolve(decode_mode.Request.of(graphs, kernels, exchange, int4_pdl))
        # the card family's tuning table, read once here and made the one the kernels launch with; so is PDL's switch
        cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
        self.tuning = tuning.use(tuning.load(cap, os.environ.get(tuning.OVERRIDE_ENV)))
        gemv_int4.use_pdl(self.mode.int4_pdl)
        self.graphs, self.kernels = self.mode.graphs, self.mode.kernels
        model.kernels = self.kernels  # the prefill runs the decoder's kernel choice (no later reads)
        self.windows = bucket_list or buckets(model.max_context)
        self.info = {**self.mode.info(), "windows": self.windows if self.graphs else None,
                     "allreduce": path.name if path is not None else None, "capture_s": None,
                     "weights": model.weights_info(), "tuning": self.tuning.info()}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._step_ms: list[float] = []  # device ms per step (graph replays), the most recent ones
        self._token_ms: list[float] = []  # wall ms per token in run(), sampling and lockstep included
        self._pending: tuple | None = None
        self._host_ms: dict[str, list[float]] = {}
        if dev.type == "cuda":
            # The host's work per token is one integer read (greedy) or one softmax over the vocabulary:
            # one thread does it. More only spin in OpenMP against the peer rank's process on the same
            # cores (docs/engine-speed.md: the served loop around a 3.8 ms step, 2026-11-30).
            torch.set_num_threads(1)
            self.info["host_threads"] = 1
        # Lockstep inside the graph (two ranks on graphs): greedy tokens are checked with the peer by the
        # step itself (engine.core.lockstep.in_graph); otherwise the rank's hook exchanges a record.
        self.guarded = self.mode.lockstep_kernels is not None
        self.checked: dict | None = None  # the in-graph check of the token sample() returned last, if any
        self.spec = None  # engine.core.spec_graphs.SpecGraphs: MTP speculation's captured rounds (prepare())
        if self.graphs:
            self.tok = torch.zeros(1, dtype=torch.long, device=dev)
            self.pos = torch.zeros(1, dtype=torch.long, device=dev)
            self._out: dict[int, torch.Tensor] = {}
            self._argmax: dict[int, torch.Tensor] = {}
            self._ls_state = torch.zeros(1, dtype=torch.long, device=dev)  # the running hash
            self._ls_flags = torch.zeros(2, dtype=torch.long, device=dev)  # (cancel, corrupt) for the next replay
            self._ls_host = (0, 0)
            self._ls_out: dict[int, torch.Tensor] = {}

    def _resolve(self, request: decode_mode.Request) -> DecodeMode:
        """The one DecodeMode of this decoder, from the request and this device, path and model."""
        model = self.model
        dev = model.device
        cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
        path = getattr(model.comm, "path", None)
        ptxas = sm70_ptxas(dev, cap)
        lockstep_kernels = False
        if path is not None:
            from engine.core import lockstep

            lockstep_kernels = lockstep.kernels_here(dev)
        return decode_mode.resolve(
            request, device_type=dev.type, capability=cap, triton_ok=triton_ok(), sm70_ptxas=ptxas,
            path_name=path.name if path is not None else None,
            capturable=model.comm is None or bool(getattr(path, "capturable", False)),
            exchange_offered=model.offers_exchange,
            lockstep_kernels=lockstep_kernels)

    # ---- the step ---------------------------------------------------------------------------------
    def step(self, tok: torch.Tensor, pos: torch.Tensor, window: int) -> torch.Tensor:
        """Model.decode_step with this decoder's kernels and exchange (eager call; what the graphs capture)."""
        return self.model.decode_step(tok, pos, window, self.kernels, self.mode.exchange)

    def window_for(self, pos: int) -> int:
        for w in self.windows:
            if pos < w:
                return w
        raise ValueError(f"position {pos} is past the context limit {self.windows[-1]}")

    @torch.inference_mode()
    def capture(self) -> dict:
        """Capture one graph per window (both ranks do this in the same order: the allreduces inside
        the warm-up steps pair up). Warm-up steps write K/V at position 0 only, which every request's
        prefill writes again before reading."""
        if not self.graphs:
            return self.info
        if getattr(self.model, "prefix", None) is not None:
            self.model.prefix.forget()  # the warm-up steps below write position 0
        t0 = time.perf_counter()
        pool = None
        zero = torch.zeros(1, dtype=torch.long, device=self.model.device)
        for w in self.windows:
            self.pos.copy_(zero)
            side = torch.cuda.Stream(self.model.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: compiles, cuBLAS workspaces, NCCL set-up
                    self.step(self.tok, self.pos, w)
            torch.cuda.current_stream().wait_stream(side)
            if self.guarded:  # the lockstep exchange's first use outside a graph (NCCL sets up lazily)
                with torch.cuda.stream(side):
                    self._lockstep(torch.zeros((), dtype=torch.long, device=self.model.device))
                torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._out[w] = self.step(self.tok, self.pos, w)
                self._argmax[w] = torch.argmax(self._out[w])  # greedy's token, computed in the graph
                if self.guarded:
                    self._ls_out[w] = self._lockstep(self._argmax[w])
            pool = g.pool()
            self._graphs[w] = g
        torch.cuda.synchronize(self.model.device)
        self._check()
        self.info["capture_s"] = round(time.perf_counter() - t0, 2)
        return self.info

    def _lockstep(self, tok: torch.Tensor) -> torch.Tensor:
        from engine.core import lockstep

        return lockstep.in_graph(tok, self.pos, self._ls_state, self._ls_flags, self.model.comm.path.all_gather,
                                 kernels=self.mode.lockstep_kernels)

    def guards(self, sampler: Sampler) -> bool:
        """Whether this sampler's tokens are checked with the peer inside the step's graph."""
        return self.guarded and sampler.temperature == 0 and sampler.plain

    def graph_for(self, window: int):
        """(graph, static tok [1], static pos [1]) for the bench: it times exactly these replays."""
        return self._graphs[window], self.tok, self.pos

    def _check(self) -> None:
        path = getattr(self.model.comm, "path", None)
        if path is not None and hasattr(path, "check"):
            path.check()

    @torch.inference_mode()
    def logits(self, tok: int, pos: int, flags: tuple[int, int] | None = None) -> torch.Tensor:
        """``flags``: (cancel, corrupt) that this step's in-graph lockstep carries (guarded decoders)."""
        dev = self.model.device
        if not self.graphs:
            t = torch.tensor([tok], device=dev)
            p = torch.tensor([pos], device=dev)
            return self.step(t, p, pos + 1)
        w = self.window_for(pos)
        if w not in self._graphs:
            raise RuntimeError(f"no graph for window {w}: call capture() first")
        comm = self.model.comm
        if comm is not None and getattr(comm, "stall_s", 0) > 0:
            comm._maybe_stall()  # fault injection: the peer's wait inside its graph runs out
        self.tok.fill_(tok)
        self.pos.fill_(pos)
        flags = tuple(int(f) for f in (flags or (0, 0)))
        if self.guarded and flags != self._ls_host:  # written only when they change: no copy per step
            self._ls_flags.copy_(torch.tensor(flags, dtype=torch.long))
            self._ls_host = flags
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._graphs[w].replay()
        end.record()
        self._settle()
        self._pending = (start, end)
        return self._out[w]

    def _settle(self) -> None:
        """Read the previous step's device time (its events are long done) and check the path."""
        if self._pending is not None:
            s, e = self._pending
            if not e.query():  # stats() asked while the step still runs (another thread): next time
                return
            self._step_ms.append(s.elapsed_time(e))
            del self._step_ms[:-256]
            self._pending = None

    def forget_stats(self) -> None:
        """Drop the step and token times so far (warm_up()'s request is not what the service reports)."""
        if self._pending is not None and self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        self._pending = None
        self._step_ms.clear()
        self._token_ms.clear()
        self._host_ms.clear()

    def after_step(self) -> None:
        """After the logits were read back: a GPU-side wait that timed out fails here, in its step."""
        if self.graphs:
            self._check()

    def sample(self, sampler: Sampler, logits: torch.Tensor) -> int:
        """The next token. Greedy on a GPU: argmax where the logits are (the first maximum on ties, as
        Sampler's CPU argmax), so only one integer crosses to the host instead of the vocabulary."""
        self.checked = None
        if logits.device.type == "cuda" and sampler.temperature == 0 and sampler.plain:
            for w, out in (self._out.items() if self.graphs else ()):
                if out is logits:
                    if self.guarded:  # the token and its check with the peer in one read-back
                        from engine.core import lockstep

                        self.checked = lockstep.read(self._ls_out[w].tolist())
                        return self.checked["token"]
                    return int(self._argmax[w])
            return int(torch.argmax(logits))
        return sampler(logits)

    def note_host_ms(self, sample_ms: float, hook_ms: float, launch_ms: float) -> None:
        """Host time per token: waiting for the step and sampling; the hook (lockstep, sending the
        token); launching the next step."""
        for key, v in (("sample", sample_ms), ("hook", hook_ms), ("launch", launch_ms)):
            lst = self._host_ms.setdefault(key, [])
            lst.append(v)
            del lst[:-256]

    def note_token_ms(self, ms: float) -> None:
        self._token_ms.append(ms)
        del self._token_ms[:-256]

    def stats(self, read_bw_gbps: float | None = None) -> dict:
        """What the service reports: decode ms per step (device, graph replays) and per token (wall, the
        loop's sampling and lockstep included), and the weight bytes this rank reads per step over that
        time (GB/s per card; ``read_bw_gbps``: the card's measured read bandwidth, e.g. from the plan)."""
        self._settle()
        m = self.model
        step_ms = statistics.median(self._step_ms) if self._step_ms else None
        token_ms = statistics.median(self._token_ms) if self._token_ms else None
        w = m.weight_bytes()
        ms = step_ms or token_ms
        gbps = round(w / (ms * 1e-3) / 1e9, 3) if ms else None
        host = {k: round(statistics.median(v), 4) for k, v in self._host_ms.items() if v}
        return {**self.info, "steps": len(self._step_ms) or len(self._token_ms), "host_ms": host or None,
                "step_ms": None if step_ms is None else round(step_ms, 4),
                "token_ms": None if token_ms is None else round(token_ms, 4),
                "weight_bytes": w, "achieved_gbps": gbps,
                "read_bw_fraction": round(gbps / read_bw_gbps, 4) if gbps and read_bw_gbps else None}


def describe(info: dict) -> str:
    """One log line: how the decode step runs here and why."""
    s = f"decode {info['mode']} ({info['why']}); kernels {info['kernels']} ({info['kernels_why']})"
    if info.get("exchange"):
        s += f"; exchange {info['exchange']} ({info['exchange_why']})"
    if info.get("windows"):
        s += f"; windows {info['windows']}; captured in {info['capture_s']} s"
    if info.get("lockstep"):
        s += f"; lockstep {info['lockstep']}"
    spec = info.get("speculation")
    if spec:
        s += f"; speculation mtp, {spec['draft_tokens']} drafts per round, {spec['mode']}" + (
            f" ({spec['graphs']} graphs captured in {spec['capture_s']} s)" if spec["graphs"] else "")
    return s


def prepare(model: Model, prefix_cache_bytes: int | None = None, spec_tokens: int = 0, **kw) -> Decoder:
    """Build the model's decoder (and capture its graphs); run() uses it from then on. ``prefix_cache_bytes``:
    the budget of engine.core.prefix's snapshots (None: its default; 0: no prefix reuse at all). ``spec_tokens``
    K > 0 on graphs: MTP speculation's rounds are captured too (engine.core.spec_graphs, ``decoder.spec``);
    ``info["speculation"]`` says how they run."""
    from engine.core.prefix import DEFAULT_BUDGET_BYTES, PrefixCache

    budget = DEFAULT_BUDGET_BYTES if prefix_cache_bytes is None else prefix_cache_bytes
    model.prefix = PrefixCache(model, budget) if budget > 0 else None
    dec = model.decoder = Decoder(model, **kw)
    dec.capture()
    if spec_tokens and dec.graphs and getattr(model, "mtp", None) is not None:
        from engine.core.spec_graphs import SpecGraphs

        try:
            dec.spec = SpecGraphs(model, spec_tokens, dec.windows)
            dec.spec.capture()
            dec.info["speculation"] = dict(dec.spec.info, mode="graphs")
        except (RuntimeError, ValueError) as e:  # rounds run eagerly, correct and slower; the reason is shown
            dec.spec = None
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            dec.info["speculation"] = {"draft_tokens": spec_tokens, "mode": "eager", "graphs": 0, "capture_s": None,
                                       "why": f"capturing the speculative rounds failed: {type(e).__name__}: {e}"}
    elif spec_tokens:
        dec.info["speculation"] = {"draft_tokens": spec_tokens, "mode": "eager", "graphs": 0, "capture_s": None}
    return dec


WARM_UP_PROMPT = 80  # tokens: a full and a partial chunk of the delta rule's 64, and the last token's own step


@torch.inference_mode()
def warm_up(model: Model, chunk: int = 2048, spec_tokens: int = 0) -> float:
    """Serve one short greedy request that nobody sees, so that the first real one does not pay what a new
    process does once on the prefill and sampling paths (kernels loaded, libraries initialised: prepare()'s
    capture covers only the decode step). Both ranks run the same request, so their collectives pair up.
    The prefix cache and the decode statistics forget it. Returns the seconds it took."""
    t0 = time.perf_counter()
    vocab = model.cfg.vocab_size
    n = min(WARM_UP_PROMPT, model.max_context - 4)
    if n < 1:  # a context too short for a request of its own: nothing to warm
        return 0.0
    run(model, [(31 * i + 7) % vocab for i in range(n)], 3, Sampler(0.0, 1.0, 0), set(), chunk,
        spec_tokens=spec_tokens)
    if getattr(model, "prefix", None) is not None:
        model.prefix.forget()
        model.prefix.hits = model.prefix.reused_tokens = 0
    dec = getattr(model, "decoder", None)
    if dec is not None:
        dec.forget_stats()
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - t0


def run(model: Model, prompt_ids: list[int], max_tokens: int, sampler: Sampler, stop_ids: set[int],
        chunk: int, hook: StepHook | None = None, on_token: Callable[[int, int], None] | None = None,
        flags: Callable[[int], tuple[int, int]] | None = None, info: dict | None = None,
        spec_tokens: int = 0) -> tuple[list[int], str]:
    """Returns (generated ids, finish_reason in length | stop | cancelled). With ``model.prefix`` (an
    engine.core.prefix.PrefixCache) the prompt's positions the model already holds are not prefilled again;
    ``info["cached_tokens"]`` says how many (the first prefill chunk then starts there); a speculating request
    reuses only positions whose MTP draft-layer K/V the cache also holds (engine.core.prefix).

    On a guarded decoder (two ranks on graphs, greedy), the step that produces token k carries
    ``flags(k)`` = (cancel, corrupt) into its in-graph lockstep, and ``decoder.checked`` holds token k's
    check when ``hook('decode', k, ...)`` runs (None where the hook must exchange a record itself:
    token 0, which prefill produces, and sampled tokens).

    ``spec_tokens`` K > 0: speculative decoding with the model's MTP draft layer (engine.core.mtp: K drafts per
    round, verified in one forward; greedy gives exactly the tokens of K = 0); ``info["spec"]`` counts the
    drafted and accepted tokens. Its rounds replay ``decoder.spec``'s graphs where prepare() captured them (else
    eagerly); every token goes through the hook."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt_ids) >= model.max_context:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {model.max_context}")
    decoder = getattr(model, "decoder", None) or prepare(model, spec_tokens=spec_tokens)
    drafting = None
    if spec_tokens:
        from engine.core import mtp

        mtp.check_draft_tokens(model, spec_tokens)
    max_tokens = min(max_tokens, model.max_context - len(prompt_ids))
    prefix = getattr(model, "prefix", None)
    first = prefix.plan(prompt_ids, drafting=bool(spec_tokens)) if prefix is not None else 0
    if info is not None:
        info["cached_tokens"] = first
    if spec_tokens:
        drafting = mtp.Prefill(model, prompt_ids, first, prefix)
    logits = None
    n = len(prompt_ids)
    # chunks from the first position to prefill; with a prefix cache the last prompt token is a step of its own,
    # so the state one token before the end can be kept (the same prompt again reuses all but that token)
    bounds = list(range(first, n, chunk)) + [n]
    if prefix is not None and prefix.linear and n - 1 > first and n - 1 not in bounds:
        bounds.insert(-1, n - 1)
    for ci, (start, end) in enumerate(zip(bounds, bounds[1:])):
        piece = prompt_ids[start:end]
        logits = model.forward(torch.tensor([piece], device=model.device), start, hidden=drafting is not None)  # [V]
        if drafting is not None:
            logits, hidden = logits
            drafting.chunk(start, hidden)
        if prefix is not None:
            prefix.fed(piece, start)
            if end == n - 1 or (end < n and end // SNAPSHOT_EVERY > start // SNAPSHOT_EVERY):
                prefix.snapshot(end)
        if hook and hook("prefill", ci, piece, end):
            return [], "cancelled"
    if drafting is not None:
        if max_tokens <= 0:
            return [], "length"
        return mtp.decode(model, decoder, logits, drafting.pending, n, max_tokens, sampler, stop_ids, spec_tokens,
                          hook, on_token, info, prefix)
    out: list[int] = []
    pos = len(prompt_ids)
    t_last = None
    for k in range(max_tokens):
        t0 = time.perf_counter()
        tok = decoder.sample(sampler, logits)
        decoder.after_step()
        t1 = time.perf_counter()
        more = k + 1 < max_tokens and tok not in stop_ids
        # Graphs: the next step goes to the GPU before the hook checks this token with the peer and hands
        # it out, so the GPU computes while the host does that. The hook's exchange queues behind the
        # step on the same stream (both ranks: step, exchange, step, ...) and it still decides whether
        # the token reaches the client; a cancel or a failure discards the step in flight.
        ahead = None
        if more and decoder.graphs:
            ahead = decoder.logits(tok, pos, flags(k + 1) if flags and decoder.guards(sampler) else None)
            if prefix is not None:
                prefix.fed([tok], pos)  # the step in flight has written position pos
        if hook and hook("decode", k, [tok], pos + 1):
            return out, "cancelled"
        out.append(tok)
        if on_token:
            on_token(k, tok)
        t2 = time.perf_counter()
        if t_last is not None:
            decoder.note_token_ms((t2 - t_last) * 1e3)
        t_last = t2
        if tok in stop_ids:
            return out, "stop"
        if more:
            if ahead is None:
                logits = decoder.logits(tok, pos)
                if prefix is not None:
                    prefix.fed([tok], pos)
            else:
                logits = ahead
            pos += 1
        decoder.note_host_ms((t1 - t0) * 1e3, (t2 - t1) * 1e3, (time.perf_counter() - t2) * 1e3)
    return out, "length"
