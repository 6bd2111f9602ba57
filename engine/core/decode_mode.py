"""How the decode step runs here, decided once: one frozen DecodeMode that engine.core.runner's Decoder resolves
when it is built (from its arguments, the environment read once and the card's facts) and passes into every step,
capture and exchange. Nothing that runs during a step reads the environment. Stdlib only: the choices are plain
functions of plain facts, tested without a GPU.

  graphs    CUDA graphs per context bucket (with the allreduce inside when the path can be captured), or eager steps.
  kernels   the decode step's blocks (KERNELS): "fused" (engine.kernels.decode: five Triton kernels per layer) or
            "eager" (the plain blocks).
  exchange  where a TP2 layer's two partial outputs meet (EXCHANGES): "kernel" (an allreduce between the GEMVs) or
            "send" (the GEMVs send their rows, a small kernel receives); None at TP1.

Measured slower and deleted (docs/engine-speed.md, history): the kernel choices "gemv" (torch.compile'd blocks with
the Triton GEMV) and "compiled" (the same with cuBLAS products), the exchange "norm-receive" (earlier "gemv").
  lockstep  how the two ranks check each other (LOCKSTEP): inside the step's graph as two Triton kernels or as torch
            ops around the exchange, or a record the rank exchanges after each step; None at TP1.
  int4_pdl  whether the int4 GEMV may launch while its row kernel still runs (programmatic dependent launch; it does
            where the card and Triton have it: engine.kernels.gemv_int4.pdl_enabled); INT4_PDL_ENV=0 turns it off.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Mapping

KERNELS_ENV = "V100PLAN_ENGINE_KERNELS"  # eager | fused: overrides the automatic choice
KERNELS = ("eager", "fused")
# "fused" (engine.kernels.decode: five kernels per layer) is the choice on cards that run Triton: an H200
# measured the Qwen3-8B step at 4.35 vs 4.67 ms (TP1) and 2.52 vs 2.89 ms (one TP2 rank) against the deleted
# "gemv" blocks (docs/engine-speed.md).
TRITON_MIN_CC = (8, 0)  # bf16 and the fused kernels from Ampere on; 7.x through engine.core.sm70
VOLTA_CC = (7, 0)  # the V100: the fused kernels only (fp16, compiled for sm_70 by a CUDA 12 ptxas: engine.core.sm70)

EXCHANGE_ENV = "V100PLAN_ENGINE_EXCHANGE"
INT4_PDL_ENV = "V100PLAN_ENGINE_INT4_PDL"  # "0": the int4 GEMV launched after its row kernel as any kernel (no overlap)
EXCHANGES = {
    "kernel": "an allreduce kernel between the GEMVs (the graph mailbox's: send, wait, add in one kernel)",
    "send": ("o_proj / down send their rows to the peer in their epilogue; a small kernel waits for and adds "
             "them before the next norm GEMV"),
}
# The measured choice (2 x H200, Qwen3-8B shape, bf16, 1K context, one bench-tp2 run, 2026-12-01,
# tests/fixtures/multigpu/h200x2-exchange-modes-2026-12-01.json; docs/engine-speed.md): the TP2 step took
# 2.742 ms with "send", 2.843 ms with "kernel" (and 3.028 ms with the deleted "norm-receive").
EXCHANGE_DEFAULT = "send"

LOCKSTEP = {
    "graph-kernels": "two Triton kernels around the exchange",
    "graph-torch": "torch ops around the exchange",
    "after-step": "after each step",
}
IN_GRAPH = "in the step's graph (greedy tokens; sampled ones exchanged after the step)"


@dataclasses.dataclass(frozen=True)
class Request:
    """What was asked for: the Decoder's arguments, else the environment (read once, here); None = choose."""
    graphs: bool | None = None
    kernels: str | None = None
    exchange: str | None = None
    int4_pdl: bool | None = None

    @classmethod
    def of(cls, graphs: bool | None = None, kernels: str | None = None, exchange: str | None = None,
           int4_pdl: bool | None = None, environ: Mapping[str, str] | None = None) -> "Request":
        env = os.environ if environ is None else environ
        kernels = kernels or env.get(KERNELS_ENV) or None
        if kernels is not None and kernels not in KERNELS:
            raise ValueError(f"{KERNELS_ENV}={kernels!r}: expected one of {', '.join(KERNELS)}")
        asked = exchange or env.get(EXCHANGE_ENV) or None
        if asked is not None and asked not in EXCHANGES:
            raise ValueError(f"{EXCHANGE_ENV}={asked!r}: expected one of {', '.join(EXCHANGES)}")
        if int4_pdl is None and env.get(INT4_PDL_ENV) == "0":
            int4_pdl = False
        return cls(graphs, kernels, asked, int4_pdl)


@dataclasses.dataclass(frozen=True)
class DecodeMode:
    """How the decode step runs, each field with why."""
    graphs: bool
    graphs_why: str
    kernels: str
    kernels_why: str
    exchange: str | None = None  # None: one rank, nothing exchanged
    exchange_why: str | None = None
    lockstep: str | None = None  # None: one rank, nothing to check
    lockstep_why: str | None = None
    int4_pdl: bool = True  # False: engine.kernels.gemv_int4 never launches with PDL (Request.int4_pdl)

    @property
    def lockstep_kernels(self) -> bool | None:
        """lockstep.in_graph's ``kernels``: its two Triton kernels, torch ops, or None outside a graph."""
        return {"graph-kernels": True, "graph-torch": False}.get(self.lockstep or "")

    def info(self) -> dict:
        """The keys the service reports (/health, the log line, /metrics): mode, why, kernels, kernels_why and,
        with two ranks, exchange, exchange_why and lockstep (its why)."""
        out = {"mode": "graphs" if self.graphs else "eager", "why": self.graphs_why, "kernels": self.kernels,
               "kernels_why": self.kernels_why, "lockstep": self.lockstep_why}
        if self.exchange is not None:
            out.update(exchange=self.exchange, exchange_why=self.exchange_why)
        return out


def graph_choice(device_type: str, path_name: str | None, capturable: bool,
                 requested: bool | None = None) -> tuple[bool, str]:
    """(graphs, why): CUDA graphs where the allreduce (if any) can be captured; eager on CPU."""
    if requested is not None:
        return requested, "requested"
    if device_type != "cuda":
        return False, "CPU: eager steps"
    if not capturable:
        return False, f"allreduce {path_name} waits on the host, which a CUDA graph cannot hold: eager steps"
    return True, "CUDA graphs per context bucket" + (f", allreduce {path_name} captured inside" if path_name else "")


def kernel_choice(device_type: str, capability: tuple[int, int] | None, triton_ok: bool,
                  requested: str | None = None, sm70_ptxas: tuple[bool, str] | None = None) -> tuple[str, str]:
    """("fused" | "eager", why). The fused kernels need Triton for the card; never required: CPUs run the plain
    blocks. The V100 (7.x) runs the fused kernels in fp16
    when ``sm70_ptxas`` (engine.core.sm70.use(): found, why) says a ptxas compiles sm_70; else the plain blocks."""
    if requested == "eager":
        return "eager", f"{KERNELS_ENV}=eager"
    if device_type != "cuda":
        return "eager", "CPU: the blocks run eagerly"
    cc = ".".join(map(str, capability)) if capability else "unknown"
    if capability is None or tuple(capability) < VOLTA_CC:
        return "eager", f"compute capability {cc} < 7.0: no Triton kernels on this card, eager blocks"
    if not triton_ok:
        return "eager", "Triton is not installed: eager blocks"
    if tuple(capability) < TRITON_MIN_CC:
        found, why = sm70_ptxas or (False, "no ptxas for sm_70 was looked for")
        if not found:
            return "eager", f"compute capability {cc} < 8.0 and {why}: eager blocks in fp16 (about half the fused speed)"
        return "fused", (f"compute capability {cc} (fp16): the five fused Triton kernels per layer, compiled for "
                         f"sm_{capability[0]}{capability[1]} by {why}; FMA instead of tensor-core MMA, which the "
                         f"one-row products do not need")
    return "fused", ("requested: " if requested == "fused" else "") + (
        "five Triton kernels per layer (engine.kernels.decode): the norm and SiLU in the GEMVs' prologues, "
        "one kernel for q/k norm, RoPE, the cache write and the one-query attention (0.93x the step of the "
        "Triton GEMV with compiled blocks at TP1, 0.87x at TP2 on an H200, docs/engine-speed.md)")


def exchange_choice(path_name: str | None, offered: bool,
                    requested: str | None = None) -> tuple[str | None, str | None]:
    """(exchange, why): None at TP1 (no path); the requested mode (else EXCHANGE_DEFAULT) where the blocks and the
    path take the exchange inside the GEMVs (``offered``); else "kernel", the path's allreduce between them."""
    if path_name is None:
        return None, None
    mode = requested or EXCHANGE_DEFAULT
    if not offered or mode == "kernel":
        return "kernel", f"an allreduce ({path_name}) between the GEMVs"
    return mode, EXCHANGES[mode]


def lockstep_choice(path_name: str | None, graphs: bool, kernels_here: bool) -> tuple[str | None, str | None]:
    """(lockstep, why): with two ranks on graphs, inside the step's graph (greedy tokens), as two Triton kernels
    where ``kernels_here`` (engine.core.lockstep.kernels_here) else torch ops; without graphs, after each step."""
    if path_name is None:
        return None, None
    if not graphs:
        return "after-step", LOCKSTEP["after-step"]
    how = "graph-kernels" if kernels_here else "graph-torch"
    return how, f"{IN_GRAPH}: {LOCKSTEP[how]}"


def resolve(request: Request, *, device_type: str, capability: tuple[int, int] | None, triton_ok: bool,
            sm70_ptxas: tuple[bool, str] | None, path_name: str | None, capturable: bool,
            exchange_offered: Callable[[str], bool], lockstep_kernels: bool) -> DecodeMode:
    """The one DecodeMode. ``exchange_offered(kernels)``: whether those kernels' blocks, the model and the path take
    the exchange inside the GEMVs; ``lockstep_kernels``: whether the lockstep's Triton kernels run on this card."""
    graphs, graphs_why = graph_choice(device_type, path_name, capturable, request.graphs)
    kernels, kernels_why = kernel_choice(device_type, capability, triton_ok, request.kernels, sm70_ptxas)
    offered = path_name is not None and exchange_offered(kernels)
    exchange, exchange_why = exchange_choice(path_name, offered, request.exchange)
    lockstep, lockstep_why = lockstep_choice(path_name, graphs, lockstep_kernels)
    return DecodeMode(graphs, graphs_why, kernels, kernels_why, exchange, exchange_why, lockstep, lockstep_why,
                      int4_pdl=request.int4_pdl is not False)
