"""``python -m probes [--quick | --soak S] [--duration S] [--only KEY,...] [--out FILE] [--progress]``

Prints one ProbeReport JSON document on stdout. With --progress, one JSON line per case
start and end goes to stderr so a caller can draw progress. Exit codes: 0 all passed
or warned, 1 something failed or errored, 3 nothing could be measured (all waived).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# NVML numbers cards by PCI bus; make CUDA use the same order so index i is one card in both.
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")

from probes import cases, inventory, runner  # noqa: E402
from probes.assemble import build  # noqa: E402
from probes.context import Options, ProbeContext  # noqa: E402

EXIT = {"passed": 0, "warned": 0, "failed": 1, "nothing_measured": 3}


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m probes", description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a throttle load of 4-10 s (until power is steady) and fewer repeats")
    mode.add_argument("--soak", type=float, metavar="S", help="a long load of S seconds for the throttle case")
    ap.add_argument("--duration", type=float, metavar="S", help="load duration of the throttle case in seconds")
    ap.add_argument("--only", default="", help="comma-separated case keys to run (default: all)")
    ap.add_argument("--no-samples", action="store_true", help="leave raw throttle samples out of the report")
    ap.add_argument("--out", help="also write the report to this file")
    ap.add_argument("--progress", action="store_true", help="JSON progress lines on stderr")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    all_cases = cases.registry()
    if a.list:
        for c in all_cases:
            print(f"{c.key}\t{c.description}")
        return 0
    only = tuple(k for k in a.only.split(",") if k)
    unknown = [k for k in only if k not in {c.key for c in all_cases}]
    if unknown:
        print(f"unknown case key(s) {unknown}; known: {[c.key for c in all_cases]}", file=sys.stderr)
        return 2
    mode = "quick" if a.quick else ("soak" if a.soak else "standard")
    if a.duration is not None and a.duration <= 0 or a.soak is not None and a.soak <= 0:
        print("a duration must be positive", file=sys.stderr)
        return 2
    options = Options.for_mode(mode, a.soak or a.duration, only)
    if a.no_samples:
        options = Options(**{**options.__dict__, "keep_samples": False})
    selected = [c for c in all_cases if not only or c.key in only]

    def progress(event: dict) -> None:
        if a.progress:
            print(json.dumps(event), file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    ctx = ProbeContext(options)
    inventory.discover(ctx)
    results = runner.run_cases(selected, ctx, progress)
    report = build(ctx, results, time.perf_counter() - t0).to_dict()
    text = json.dumps(report, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return EXIT[report["overall"]]


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A timed-out case may leave a daemon thread inside a GPU call: do not wait for it at exit.
    os._exit(code)
