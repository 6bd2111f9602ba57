"""`python -m engine make-demo-model DIR`: write the v100plan-demo model and print a JSON summary."""

from __future__ import annotations

import argparse
import json


def main(argv: list[str]) -> int:
    from engine.core import demo

    p = argparse.ArgumentParser(prog="python -m engine make-demo-model", description=__doc__.splitlines()[0])
    p.add_argument("dir", help="output directory (created)")
    p.add_argument("--seed", type=int, default=demo.SEED, help="PCG64 seed (the default is the tested one)")
    args = p.parse_args(argv)
    print(json.dumps(demo.make(args.dir, args.seed)))
    return 0
