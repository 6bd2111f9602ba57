"""`python -m engine.bench.prefix_ttft`: time to first token through the HTTP service for a long conversation,
cold and with the prefix the ranks still hold: the follow-up turn (the conversation + its answer + new tokens)
and the same prompt again.

A random-weight checkpoint of --config (optionally cut to --layers, keeping the layer pattern) is written to
disk, `python -m engine serve --tp 2` runs on it as a user starts it, and each request is a streamed
completion of token ids whose first SSE event's arrival is the TTFT (median of --repeats where noted).
Prints one JSON document (also written to --out).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import time
from pathlib import Path

from engine import DATA_DIR
from engine.bench.served import end_serve, start_serve, wait_healthy, write_random_checkpoint


def first_event(port: int, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(seconds to the first streamed token, the token ids streamed)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1200)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"/v1/completions answered {r.status}: {r.read()[:300]!r}")
    first, ids, buf = None, [], b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            line = ev.decode(errors="replace").strip()
            if line.startswith("data: {"):
                if first is None:
                    first = time.perf_counter() - t0
                ids += (json.loads(line[6:]).get("v100plan") or {}).get("token_ids") or []
    c.close()
    return first, ids


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.prefix_ttft", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DATA_DIR / "qwen3.5-27b.config.json"))
    p.add_argument("--layers", type=int, default=16, help="layers kept (the pattern of the config's layer kinds)")
    p.add_argument("--devices", default="cuda:0,cuda:0")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--conversation", type=int, default=100_000, help="prompt tokens of the long conversation")
    p.add_argument("--new", type=int, default=200, help="new tokens of the follow-up turn")
    p.add_argument("--answer", type=int, default=8, help="tokens generated for the first turn")
    p.add_argument("--max-context", type=int, default=131072)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    raw = json.loads(Path(args.config).read_text())
    raw["num_hidden_layers"] = args.layers
    raw.pop("layer_types", None)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="v100plan-prefix-"))
    cfg_path = work / "config.json"
    work.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(json.dumps(raw))
    doc: dict = {"kind": "engine_bench_prefix_ttft", "config": Path(args.config).name, "layers": args.layers,
                 "devices": args.devices, "dtype": args.dtype, "conversation": args.conversation, "new": args.new,
                 "method": __doc__.strip()}

    def emit():
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    doc["checkpoint"] = write_random_checkpoint(str(cfg_path), work / "model", args.dtype, args.devices.split(",")[0])
    import torch

    torch.cuda.empty_cache()
    proc, port, doc["serve_command"], log = start_serve(work, args.devices, args.dtype, args.max_context)
    try:
        doc["health"] = wait_healthy(port, proc, 600)
        v = min(30000, raw["vocab_size"] - 10)
        conv = [(7 * i + 3) % v + 10 for i in range(args.conversation)]
        t, answer = first_event(port, conv, args.answer)
        doc["cold_ttft_s"] = round(t, 3)
        emit()
        follow = conv + answer + [(11 * i + 5) % v + 10 for i in range(args.new)]
        t, _ = first_event(port, follow, 4)
        doc["follow_up_ttft_s"] = round(t, 3)
        emit()
        t, _ = first_event(port, follow, 4)
        doc["repeat_ttft_s"] = round(t, 3)
        emit()
        # a second follow-up of another length (the first turn's answer and 137 new tokens): what a turn costs once
        # the service has seen a follow-up, so that a first-seen cost (a compilation) shows as the difference
        follow2 = follow + [(17 * i + 2) % v + 10 for i in range(137)]
        t, _ = first_event(port, follow2, 4)
        doc["follow_up_2_ttft_s"] = round(t, 3)
        emit()
        short = [(13 * i + 1) % v + 10 for i in range(args.new)]
        t, _ = first_event(port, short, 4)
        doc["cold_short_ttft_s"] = round(t, 3)
    except Exception as e:  # noqa: BLE001 - a failed phase is a result; the log says why
        doc["error"] = f"{type(e).__name__}: {e}"
    finally:
        end_serve(proc, log, work, doc, emit, remove=not args.workdir)
    print(json.dumps(doc, indent=1))
    return 0 if "error" not in doc else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
