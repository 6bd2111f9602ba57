"""`python -m engine rank ...`: argument parsing and a hard exit (no interpreter teardown that could hang
on a peer that is gone).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str]) -> int:
    from engine.service import rank

    p = argparse.ArgumentParser(prog="python -m engine rank", description="one tensor-parallel rank")
    rank.add_args(p)
    args = p.parse_args(argv)
    code = rank.main(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
