"""`python -m engine rank ...`: argument parsing and a hard exit (no interpreter teardown that could hang
on a peer that is gone).
"""

from __future__ import annotations

import argparse
import os
import sys

from engine import dtype_rule
from engine.allreduce.paths import ALLREDUCE_CHOICES
from engine.core import speculative
from engine.service.serve_config import DEFAULT_ALLREDUCE_TIMEOUT_S, HEARTBEAT_INTERVAL_S

DTYPES = (*dtype_rule.DTYPES, dtype_rule.AUTO)  # auto: engine.dtype_rule for this rank's card
READ_BW_ENV = "V100PLAN_ENGINE_READ_BW_GBPS"


def _slots(text: str) -> int | str:
    """--max-concurrency: a number of slots, or `memory` (serve passes it when it was given no number)."""
    if text == "memory":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a number of slots or memory, not {text!r}") from None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (unsharded, or a `shard` output)")
    p.add_argument("--rank", type=int, required=True, choices=(0, 1))
    p.add_argument("--world", type=int, default=2, choices=(1, 2))
    p.add_argument("--rendezvous", required=True, help="directory both ranks can reach (the gloo store)")
    p.add_argument("--control-socket", required=True, help="Unix socket path this rank listens on (0600)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--dtype", default=dtype_rule.AUTO, choices=DTYPES)
    p.add_argument("--allreduce", default="auto", choices=ALLREDUCE_CHOICES)
    p.add_argument("--max-context", type=int, default=None,
                   help="positions of the K/V cache (default: the model's native context, bounded on a GPU by what "
                        "fits the card: engine/service/context_default.py)")
    p.add_argument("--card-share", type=float, default=1.0,
                   help="this rank's share of its card's memory for the default context (0.5 when both ranks share "
                        "one card; default: %(default)s)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                   help="auto: the model's dtype; int8: engine.core.kvquant (default: auto)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt from its first token (default: reuse what the ranks hold, "
                        "engine.core.prefix)")
    p.add_argument("--no-batch-graphs", dest="batch_graphs", action="store_false",
                   help="N > 1: the batched step launched eagerly, not replayed from CUDA graphs "
                        "(engine/service/batch_graphs.py)")
    speculative.add_arguments(p)
    p.add_argument("--no-vision", action="store_true",
                   help="do not load the checkpoint's vision tower (its memory stays free; images are refused)")
    p.add_argument("--generation", type=int, default=0, help="start counter from the supervisor (epoch)")
    p.add_argument("--enable-fault-injection", action="store_true")
    p.add_argument("--allreduce-timeout-s", type=float, default=DEFAULT_ALLREDUCE_TIMEOUT_S)
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill step (default: 2048 on a GPU, as the field's engine, 256 on CPU)")
    p.add_argument("--max-concurrency", type=_slots, default=1,
                   help="sequence slots; above 1 requests decode together (engine/service/rank_batch.py); memory: as "
                        "many sequences of the context as fit this rank's card, at most 64, the smaller of the two "
                        "ranks' figures (engine/service/concurrency_default.py; default: 1)")
    p.add_argument("--heartbeat-interval-s", type=float, default=HEARTBEAT_INTERVAL_S,
                   help="period of the heartbeat on the control socket once ready (0: none)")
    p.add_argument("--fail-selftest", action="append", default=[],
                   help="(fault injection only) make this path's self-test fail on this rank")
    env_bw = os.environ.get(READ_BW_ENV)
    p.add_argument("--read-bw-gbps", type=float, default=float(env_bw) if env_bw else None,
                   help=f"the card's read bandwidth in GB/s, for the achieved fraction the service reports "
                        f"(default: ${READ_BW_ENV}, else measured by the rank at start)")
    p.add_argument("--read-bw-source", choices=("flag", "measured earlier"), default="flag",
                   help="where --read-bw-gbps came from: the service passes 'measured earlier' to a restarted "
                        "rank, with what the previous rank on the same card measured (default: flag)")




def main(argv: list[str]) -> int:
    from engine.service import rank

    p = argparse.ArgumentParser(prog="python -m engine rank", description="one tensor-parallel rank")
    add_args(p)
    args = p.parse_args(argv)
    code = rank.main(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
