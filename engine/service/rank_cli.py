"""`python -m engine rank ...`: argument parsing and a hard exit (no interpreter teardown that could hang
on a peer that is gone).

`python -m engine rank --standby` is a rank started ahead of need: it imports torch and the engine
(most of a rank's start on a CPU host) and then waits for one line on stdin, its real arguments as
a JSON list. The service keeps one such pair per next generation, so a restart after a fault skips
the imports. End of input without a line: exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _preload() -> None:
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401

        from engine.allreduce import (  # noqa: F401
            comm,  # noqa: F401
            dist,
            host_mailbox,
            select,
        )
    except Exception:  # noqa: BLE001 - the real start reports any import problem with its context
        pass


def main(argv: list[str]) -> int:
    if argv[:1] == ["--standby"]:
        _preload()
        line = sys.stdin.readline()
        if not line.strip():
            os._exit(0)
        argv = [str(a) for a in json.loads(line)]
    from engine.service import rank

    p = argparse.ArgumentParser(prog="python -m engine rank", description="one tensor-parallel rank")
    rank.add_args(p)
    args = p.parse_args(argv)
    code = rank.main(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
