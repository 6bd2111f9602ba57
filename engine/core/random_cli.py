"""`python -m engine make-random-model DIR --config CONFIG`: a random-weights model of a config's shape (weights
generated on the card at load, engine.core.random_weights); prints a JSON summary."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from engine.core import random_weights

    p = argparse.ArgumentParser(prog="python -m engine make-random-model", description=__doc__.splitlines()[0])
    p.add_argument("dir", help="output directory (created; must not hold safetensors files)")
    p.add_argument("--config", required=True,
                   help="a Hugging Face config.json (e.g. engine/data/qwen3.5-27b.config.json, the 27B hybrid shape)")
    p.add_argument("--layers", type=int, default=None,
                   help="keep this many layers, in the config's pattern of layer kinds (default: all)")
    p.add_argument("--seed", type=int, default=0, help="the generator's seed (default: 0)")
    args = p.parse_args(argv)
    try:
        raw = json.loads(Path(args.config).read_text())
    except (OSError, ValueError) as e:
        print(f"Error: cannot read --config {args.config}: {e}", file=sys.stderr)
        return 2
    if args.layers is not None:
        if args.layers < 1:
            print("Error: --layers must be at least 1", file=sys.stderr)
            return 2
        raw = dict(raw, num_hidden_layers=args.layers)
        if "layer_types" in raw:  # keep the pattern: the first N kinds
            raw["layer_types"] = raw["layer_types"][:args.layers]
        if isinstance(raw.get("text_config"), dict):
            tc = dict(raw["text_config"], num_hidden_layers=args.layers)
            if "layer_types" in tc:
                tc["layer_types"] = tc["layer_types"][:args.layers]
            raw["text_config"] = tc
    try:
        summary = random_weights.write(args.dir, raw, args.seed)
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
