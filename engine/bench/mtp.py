"""`python -m engine.bench.mtp`: MTP speculation's captured round against one-token decoding on a GPU, for a
config.json shape (the 27B hybrid by default) with fewer layers and random weights, printed as one JSON document.

What each number is (medians over CUDA-graph replays between CUDA events, engine.core.timing):
  step_ms           the service's decode step (engine.core.runner.Decoder's graph, its kernels) at ``context``
  verify_ms[K]      the verification graph of K + 1 positions at the same context (engine.core.spec_graphs)
  draft_ms[K][r]    the draft graph: the draft layer over the r positions the last round accepted, then K - 1
                    one-row steps (r = accepted + 1)
  rollback_ms       the linear-attention states put back to an accepted row (on the device)
  round_wall_ms[K]  a whole round as mtp.graph_round runs it, host included: draft graph, verification graph,
                    the one read-back, the rollback (r = 1: every draft rejected)
  tok_s[K][a]       expected tokens per round / round time at per-draft acceptance a (the field's 0.745 code and
                    0.49 prose rates): tokens = (1 - a^(K+1)) / (1 - a); round = E[draft] + verify + P(a < K)
                    rollback, each weighted by the distribution of the accepted count; against 1000 / step_ms
Two depths (--layers, default 8,16) give each time as fixed + per-layer x layers (the head, the draft layer and
the host are the fixed part), and ``full_depth`` projects the figures to the config's own layer count.
The prediction (``predicted``) is bytes read over the card's measured read bandwidth, made before the timing:
the verification reads the weights once for its K + 1 rows (skinny products stay bandwidth-bound), K/V once,
and moves each row's linear-attention state twice a step's bytes (the rule's read and write, then the copy kept
for the rollback read and written); kernel launches are not in it (``verify_kernels`` counts them).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import types
from pathlib import Path

from engine import DATA_DIR

RATES = (0.745, 0.49)  # per-draft acceptance: the field system on code and on prose (FACTS.md)


def tokens_per_round(a: float, k: int) -> float:
    """Expected tokens a round of k drafts gives at per-draft acceptance a: 1 + a + ... + a^k."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def accepted_dist(a: float, k: int) -> list[float]:
    """P(j drafts accepted), j = 0..k, when each is accepted with probability a until the first rejection."""
    return [a ** j * (1 - a) for j in range(k)] + [a ** k]


def _model(config: str, layers: int, dtype, context: int):
    import torch  # noqa: F401

    from engine.core import config as ecfg
    from engine.core import weights
    from engine.core.model import Model

    raw = json.loads(Path(config).read_text())
    raw["num_hidden_layers"] = layers
    raw.pop("layer_types", None)
    raw.setdefault("mtp_num_hidden_layers", 1)  # Qwen3.5 / Qwen3-Next checkpoints carry one
    m = Model(ecfg.from_dict(raw), dtype=dtype, device="cuda")
    weights.init_random(m)
    m.setup_cache(context)
    return m


def _events_ms(fn, n: int = 20) -> float:
    """Median ms per call of fn (replays, with the position fills they need) between CUDA events."""
    from engine.core import timing

    return timing.time_graph_ms(types.SimpleNamespace(replay=fn), n=n)


def _wall_ms(fn, n: int = 20, batches: int = 5) -> float:
    res = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        res.append((time.perf_counter() - t0) * 1e3 / n)
    return statistics.median(res)


def kernels_launched(fn) -> int | None:
    """GPU kernels one eager call of fn launches (torch.profiler's CUDA activity): a captured step replays the same
    ones, and at a few microseconds each their count is the verification's fixed cost beside its bytes. None when the
    profiler gives no device events here."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # noqa: BLE001 (a diagnostic: the timings stand without it)
        return None
    return n or None


def predicted(model, context: int, k: int, read_gbps: float) -> dict:
    """Bytes over read bandwidth: the step and the verification of k + 1 rows (module docstring)."""
    from engine.bench.decode import state_bytes_per_step

    w = model.weight_bytes()
    kv = model.state_bytes()["kv_cache"] // model.max_context * context
    st = state_bytes_per_step(model)
    mtp_w = sum(t.numel() * t.element_size() for _, t in model.mtp.weights()) + model.head.numel() * model.head.element_size()
    step = (w + kv + st) / read_gbps / 1e6
    verify = (w + kv + (k + 1) * 2 * st) / read_gbps / 1e6
    return {"step_ms": round(step, 4), "verify_ms": round(verify, 4), "verify_over_step": round(verify / step, 3),
            "draft_ms": round(k * mtp_w / read_gbps / 1e6, 4)}


def measure(config: str, layers: int, dtype, context: int, ks: list[int], read_gbps: float) -> dict:
    import torch

    from engine.core import mtp, runner
    from engine.core.sampling import Sampler
    from engine.core.spec_graphs import SpecGraphs

    m = _model(config, layers, dtype, context + 256)
    window = m.max_context  # one bucket: the whole allocated context
    dec = runner.prepare(m, prefix_cache_bytes=0, bucket_list=[window])
    pos0 = context - 1
    graph, _, pos = dec.graph_for(window)
    pos.fill_(pos0)
    step_tok = torch.zeros(1, dtype=torch.long, device="cuda")
    out = {"layers": layers, "kernels": dec.kernels, "window": window,
           "step_ms": round(_events_ms(graph.replay, n=50), 4),
           "step_kernels": kernels_launched(lambda: dec.step(step_tok, torch.full_like(step_tok, pos0), window)),
           "predicted": {k: predicted(m, context, k, read_gbps) for k in ks}, "K": {}}
    for k in ks:
        sg = SpecGraphs(m, k, [window])
        sg.capture()

        def verify(sg=sg, k=k):
            sg.replay_verify(k, window)

        def draft(rows, sg=sg):
            sg.pos.fill_(pos0 - rows)
            sg.replay_draft(rows, window)

        def rollback(sg=sg):
            sg.replay_rollback(0)

        sg.pos.fill_(pos0)
        row = {"verify_ms": round(_events_ms(verify), 4),
               "draft_ms": {r: round(_events_ms(lambda r=r: draft(r)), 4) for r in range(1, k + 2)},
               "rollback_ms": round(_events_ms(rollback), 4)}
        row["verify_over_step"] = round(row["verify_ms"] / out["step_ms"], 3)
        row["verify_kernels"] = kernels_launched(lambda sg=sg, k=k: sg.verify(k, window))

        def round_(sg=sg, k=k):  # graph_round's host path, every draft rejected
            sg.pos.fill_(pos0 - 1)
            sg.argmax[:1].fill_(1)
            mtp.graph_round(m, dec, sg, Sampler(), k, [1], pos0 - 1, pos0)

        row["round_wall_ms"] = round(_wall_ms(round_), 4)
        out["K"][k] = row
        del sg
        torch.cuda.empty_cache()
    m.decoder = dec.spec = None  # the graphs go with this frame (the caller empties the cache)
    return out


def rates(step_ms: float, row: dict, k: int) -> dict:
    """tok/s of a round at each RATES acceptance against one-token decoding (module docstring)."""
    out = {"plain_tok_s": round(1000 / step_ms, 2)}
    for a in RATES:
        dist = accepted_dist(a, k)
        draft = sum(p * row["draft_ms"][j + 1] for j, p in enumerate(dist))
        rms = draft + row["verify_ms"] + (1 - dist[-1]) * row["rollback_ms"]
        tps = 1000 * tokens_per_round(a, k) / rms
        out[str(a)] = {"tokens_per_round": round(tokens_per_round(a, k), 3), "round_ms": round(rms, 4),
                       "tok_s": round(tps, 2), "speedup": round(tps * step_ms / 1000, 3)}
    return out


def project(runs: list[dict], full_layers: int, ks: list[int]) -> dict:
    """Each time as fixed + per-layer x layers through the two depths, evaluated at ``full_layers``."""
    (a, b) = runs[0], runs[-1]
    la, lb = a["layers"], b["layers"]

    def at(x, y):
        return round(x + (y - x) * (full_layers - la) / (lb - la), 4)

    step = at(a["step_ms"], b["step_ms"])
    out = {"layers": full_layers, "step_ms": step, "K": {}}
    for k in ks:
        ra, rb = a["K"][k], b["K"][k]
        row = {"verify_ms": at(ra["verify_ms"], rb["verify_ms"]),
               "draft_ms": {r: at(ra["draft_ms"][r], rb["draft_ms"][r]) for r in ra["draft_ms"]},
               "rollback_ms": at(ra["rollback_ms"], rb["rollback_ms"])}
        row["verify_over_step"] = round(row["verify_ms"] / step, 3)
        row["at_rates"] = rates(step, row, k)
        out["K"][k] = row
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.mtp", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DATA_DIR / "qwen3.5-27b.config.json"))
    p.add_argument("--layers", default="8,16", help="one depth, or two (comma-separated) to project from")
    p.add_argument("--context", type=int, default=4096, help="cached positions the step and verification attend")
    p.add_argument("--draft-tokens", default="1,2,3,4")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    try:
        depths = [int(x) for x in args.layers.split(",")]
        ks = [int(x) for x in args.draft_tokens.split(",")]
    except ValueError:
        print("--layers and --draft-tokens take comma-separated integers", file=sys.stderr)
        return 2
    if not all(1 <= k <= 4 for k in ks) or not 1 <= len(depths) <= 2 or min(depths) < 1:
        print("--draft-tokens: 1 to 4 each; --layers: one or two depths of 1 or more", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("python -m engine.bench.mtp times CUDA graphs: it needs an NVIDIA GPU", file=sys.stderr)
        return 2
    from engine.core import timing

    dtype = getattr(torch, args.dtype)
    read_gbps = timing.read_bandwidth_gbps(torch.device("cuda"), 4 << 30)
    t0 = time.perf_counter()
    runs = []
    for n in depths:
        runs.append(measure(args.config, n, dtype, args.context, ks, read_gbps))
        gc.collect()
        torch.cuda.empty_cache()
    for r in runs:
        for k in ks:
            r["K"][k]["at_rates"] = rates(r["step_ms"], r["K"][k], k)
    full = json.loads(Path(args.config).read_text())["num_hidden_layers"]
    doc = {"bench": "mtp", "config": Path(args.config).name, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "dtype": args.dtype, "context": args.context, "read_bw_gbps": round(read_gbps, 1),
           "rates": list(RATES), "method": "medians of 5 batches of 20-50 CUDA-graph replays; round_wall_ms: host "
           "clock over graph_round", "runs": runs,
           "full_depth": project(runs, full, ks) if len(runs) == 2 else None,
           "seconds": round(time.perf_counter() - t0, 1)}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
