"""`python -m engine.bench.prefill_profile`: where a prefill chunk's time goes (torch.profiler, CUDA time per
operator) for a config.json shape with fewer layers, random weights on the GPU. Prints the top operators."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine import DATA_DIR


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.prefill_profile", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DATA_DIR / "qwen3.5-27b.config.json"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--kernels", default=None, choices=("eager", "fused"),
                   help="the prefill's kernel choice (default: the card's; eager: the Gated DeltaNet in torch)")
    args = p.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine.core import config as ecfg
    from engine.core import weights
    from engine.core.model import Model

    raw = json.loads(Path(args.config).read_text())
    raw["num_hidden_layers"] = args.layers
    raw.pop("layer_types", None)
    cfg = ecfg.from_dict(raw)
    m = Model(cfg, dtype=torch.bfloat16, device="cuda")
    weights.init_random(m)
    m.kernels = args.kernels
    m.setup_cache(args.tokens + 256)
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), device="cuda")

    def run():
        for s in range(0, args.tokens, args.chunk):
            m.forward(ids[:, s:s + args.chunk], s)
        torch.cuda.synchronize()

    run()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
