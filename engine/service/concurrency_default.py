"""How many requests `serve` decodes at once when it is given no --max-concurrency (docs/service.md, "Default
concurrency").

  max concurrency = --max-concurrency N                                   (bound "flag")
                  = 1 with --speculative mtp                              (bound "mtp": its rounds are graphed at N = 1)
                  = 1 on CPU                                              (bound "cpu": host memory is not planned)
                  = the sequences of the served context that fit          (bound "memory"; at least 1)
                    this rank's card beside what it holds, at most 64     (bound "cap" past 64)

The first three are serve's, from its flags and the model's config (before_ranks); the last is each GPU rank's, once its
weights (and vision tower) are on its card and its context is chosen (from_memory). The context comes first, for one
sequence (engine/service/context_default.py: native, bounded by memory), then how many sequences of it fit; with
--max-concurrency N given and no --max-context the context is the one N sequences fit. Both ranks take the smaller of
their two figures (they allocate the same slots), and the proxy keeps the first pair's figure for every restart.

What fits is engine.memory_fit's arithmetic, the planner's own (its breakdown.memory.sequences_that_fit):

  sequences that fit = (card memory x this rank's share - what the rank holds - the runtime reserve
                        - the RoPE tables of the context, shared by every slot)
                       / (the context x K/V per position of one slot + one slot's linear-attention state)

Stdlib only: serve_config imports it, and the rank passes its card's figures in.
"""

from __future__ import annotations

from engine import memory_fit
from engine.core.config import ModelConfig
from engine.service import context_default

MAX_CONCURRENCY = 64  # the most sequence slots a rank holds (the flag's bound and the default's cap)
BOUNDS = ("flag", "mtp", "cpu", "memory", "cap")


def record(n: int, bound: str, why: str, fits: int | None = None) -> dict:
    """What /health's ``concurrency`` says: the served N, the bound that chose it, why, and (memory) what fits."""
    return {"max_concurrency": n, "bound": bound, "why": why, "fits": fits}


def before_ranks(flag: int | None, *, draft_tokens: int, gpu: bool) -> dict | None:
    """The served N where serve's flags decide it, in this order: the flag, MTP, CPU. None: the GPU ranks choose it
    from their cards' memory (from_memory)."""
    if flag is not None:
        return record(flag, "flag", f"--max-concurrency {flag}")
    if draft_tokens:
        return record(1, "mtp", "one request at a time: --speculative mtp rounds run in CUDA graphs with one "
                                "sequence, eagerly one slot after another with more (engine/service/rank_batch_spec.py); "
                                "--max-concurrency N serves N at once")
    if not gpu:
        return record(1, "cpu", "one request at a time: on CPU host memory is not planned; --max-concurrency N "
                                "serves N at once")
    return None


def from_memory(context: int, cfg: ModelConfig, *, world: int, dtype_bytes: int, kv_int8: bool,
                card: context_default.Card | None) -> dict:
    """How many sequences of ``context`` positions fit this rank's card (``card`` None: CPU, bound "cpu")."""
    if card is None:
        return before_ranks(None, draft_tokens=0, gpu=False)
    reserve_gb, reserve_source = memory_fit.runtime_reserve()
    rope = context * context_default.rope_bytes_per_position(cfg, dtype_bytes)
    slot_kv = context_default.slot_kv_bytes_per_position(cfg, world, dtype_bytes, kv_int8)
    # each slot also needs room for its row of the batched step's attention workspace where the torch form runs
    # (context_default: 0 where the attention kernel reads the slot in place)
    work = context_default.batch_workspace_bytes_per_position(cfg, world, dtype_bytes, kv_int8)
    state = context_default.state_bytes(cfg, world, dtype_bytes)
    free = card.capacity_bytes - card.held_bytes - reserve_gb * memory_fit.GB - rope
    fits = memory_fit.sequences_that_fit(free, context * (slot_kv + work) + state)
    if fits < 1:  # one sequence alone runs the one-sequence step, which gathers nothing
        fits = min(1, memory_fit.sequences_that_fit(free, context * slot_kv + state))
    arithmetic = (f"({card.capacity_bytes / 1e9:.2f} GB of {card.name or 'the card'} - {card.held_bytes / 1e9:.2f} GB "
                  f"held - {reserve_gb:g} GB runtime reserve ({reserve_source.split(' (')[0]}) - {rope / 1e9:.3f} GB "
                  f"RoPE tables) / ({context} positions x ({slot_kv / 1024:.1f} KiB K/V"
                  + (f" + {work / 1024:.1f} KiB batched-step workspace" if work else "")
                  + f") + {state / 1e6:.1f} MB linear-attention state) = {fits} sequences")
    if fits > MAX_CONCURRENCY:
        return record(MAX_CONCURRENCY, "cap", f"{MAX_CONCURRENCY} at once, the most a rank holds: {arithmetic}", fits)
    if fits < 1:  # only with --max-context given: the default context fits one sequence by construction
        return record(1, "memory", f"one request at a time: not even one sequence of the context fits beside the "
                                   f"weights: {arithmetic}", fits)
    return record(fits, "memory", f"{fits} at once, as many sequences of the served context as fit: {arithmetic}",
                  fits)
