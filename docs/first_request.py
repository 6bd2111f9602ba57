"""What a new rank's first request pays once: load a model as a rank does (weights, cache, runner.prepare),
then time the same request three times and profile the first one's host time.

    python3 docs/first_request.py --model DIR --device cuda:0 [--dtype float32] [--speculative mtp] [--prompt-len 24]

A restarted service answers its first request late when that request does something the ranks did not do
at start (load a kernel, initialise a library, capture a graph): first_s >> second_s says so, and the profile
(cumulative host time, the 25 largest) says what. Prints one JSON line, then the profile.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402, TID253 - a script of its own, run on a GPU host

from engine.core import config, runner, weights  # noqa: E402
from engine.core.model import Model  # noqa: E402
from engine.core.sampling import Sampler  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--speculative", choices=("off", "mtp"), default="off")
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--warmup", action="store_true", help="run runner.warm_up first, as a rank does at start")
    a = p.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    marks = [("begin", time.monotonic())]
    cfg = config.load(a.model)
    model = Model(cfg, dtype=getattr(torch, a.dtype), device=device)
    weights.load_into(model, a.model)
    model.setup_cache(a.max_context)
    marks.append(("weights", time.monotonic()))
    spec = a.draft_tokens if a.speculative == "mtp" else 0
    runner.prepare(model, spec_tokens=spec)
    marks.append(("prepare", time.monotonic()))
    if a.warmup:
        runner.warm_up(model, spec_tokens=spec)
        marks.append(("warm_up", time.monotonic()))
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(a.prompt_len)]
    times, outs = [], []
    prof = cProfile.Profile()
    for i in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        if i == 0:
            prof.enable()
        out, _ = runner.run(model, prompt if i < 2 else prompt[::-1], a.max_tokens, Sampler(0.0, 1.0, 0), set(),
                            2048 if device.type == "cuda" else 256, spec_tokens=spec)
        if i == 0:
            prof.disable()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(round(time.perf_counter() - t0, 3))
        outs.append(out)
    phases = {n: round(t - q, 2) for (_, q), (n, t) in zip(marks, marks[1:])}
    print(json.dumps({"start": phases, "first_s": times[0], "second_s (same prompt)": times[1],
                      "third_s (new prompt)": times[2], "same_tokens": outs[0] == outs[1],
                      "device": a.device, "dtype": a.dtype, "speculative": a.speculative, "warmup": a.warmup}))
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
    print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
