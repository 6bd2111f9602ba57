"""`python -m engine make-demo-model DIR [--arch llama|qwen3_5] [--mtp | --vision]`: write a demo model and print a JSON summary."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str]) -> int:
    from engine.core import demo

    p = argparse.ArgumentParser(prog="python -m engine make-demo-model", description=__doc__.splitlines()[0])
    p.add_argument("dir", help="output directory (created)")
    p.add_argument("--arch", default="llama", choices=sorted(demo.ARCHS),
                   help="llama: v100plan-demo, a dense Llama-layout model; qwen3_5: v100plan-demo-hybrid, Gated "
                        "DeltaNet + gated attention layers as Qwen3.5 (default: llama)")
    p.add_argument("--seed", type=int, default=None, help="PCG64 seed (default: the tested one of the --arch)")
    p.add_argument("--mtp", action="store_true",
                   help="--arch qwen3_5 only: add one MTP draft layer (mtp.*) for --speculative mtp (default: off)")
    p.add_argument("--vision", action="store_true",
                   help="--arch qwen3_5 only: the multimodal demo with a small vision tower (model.visual.*), image "
                        "tokens and a chat template for image parts (default: off)")
    args = p.parse_args(argv)
    if args.vision and (args.arch != "qwen3_5" or args.mtp):
        print("Error: --vision needs --arch qwen3_5 (and no --mtp): the vision tower is Qwen3.5's", file=sys.stderr)
        return 2
    try:
        if args.vision:
            from engine.vision import demo as vision_demo

            print(json.dumps(vision_demo.make(args.dir, args.seed)))
            return 0
        summary = demo.make(args.dir, args.seed, args.arch, args.mtp)
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0
