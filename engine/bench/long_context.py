"""`python -m engine.bench.long_context`: the service serving a config's shape at its full context, through HTTP.

A random-weights model of --config (engine.core.random_weights: generated on the card at load, so the 27B shape
needs no 54 GB on disk) is served by `python -m engine serve --tp 2 --max-context N` as a user starts it; one
streamed completion whose prompt (token ids) fills the context but --tokens generated positions runs to the last
position. Recorded: the time to the first token (the prefill of the whole prompt), the gaps between the streamed
tokens there (decode at the end of the context), /health before and after (memory, buckets), and whether every
requested token came. Prints one JSON document (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from engine import DATA_DIR
from engine.bench.served import _request, end_serve, start_serve, stream_gaps, wait_healthy


class MemorySampler:
    """The cards' used memory (nvidia-smi's memory.used, MiB, summed over ``gpus``) every ``interval_s`` in a thread
    while the run goes on; ``result()``: the peak, the sample count, the interval and the command, or the reason
    there is none (no nvidia-smi, or it failed every time)."""

    def __init__(self, gpus: list[int], interval_s: float = 3.0, command: list[str] | None = None):
        import threading

        self.gpus, self.interval_s = sorted(set(gpus)), interval_s
        self.command = command or ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
        self.samples: list[int] = []
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _once(self) -> None:
        import subprocess

        try:
            out = subprocess.run(self.command, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.failure = f"{type(e).__name__}: {e}"
            return
        used = {}
        for line in out.stdout.splitlines():
            parts = [v.strip() for v in line.split(",")]
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                used[int(parts[0])] = int(parts[1])
        if out.returncode != 0 or not all(g in used for g in self.gpus):
            self.failure = f"{' '.join(self.command[:1])} exited {out.returncode}: {out.stderr.strip()[:200]}"
            return
        self.samples.append(sum(used[g] for g in self.gpus))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._once()
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def result(self) -> dict:
        if not self.samples:
            return {"max": None, "samples": 0, "reason": self.failure or "no sample was taken"}
        return {"max": max(self.samples), "samples": len(self.samples), "interval_s": self.interval_s,
                "gpus": self.gpus, "source": "nvidia-smi --query-gpu=memory.used, sampled during the same call"}


def _gpu_indices(devices: str) -> list[int]:
    return [int(d.split(":")[1]) if ":" in d else 0 for d in devices.split(",") if d.startswith("cuda")]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.long_context", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DATA_DIR / "qwen3.5-27b.config.json"))
    p.add_argument("--layers", type=int, default=None, help="keep this many layers (default: all)")
    p.add_argument("--devices", default="cuda:0,cuda:0")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-context", type=int, default=262144)
    p.add_argument("--tokens", type=int, default=32, help="tokens generated at the end of the context")
    p.add_argument("--yarn", type=float, default=None, metavar="FACTOR", help="serve past the config's positions "
                   "with YaRN RoPE scaling of FACTOR (default: the config's own rope scaling)")
    p.add_argument("--yarn-original", type=int, default=32768, help="with --yarn: the positions trained at")
    p.add_argument("--timeout-s", type=float, default=540)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from engine.core import random_cli

    work = Path(tempfile.mkdtemp(prefix="v100plan-long-"))
    mk = ["--config", args.config, "--seed", "0"] + (["--layers", str(args.layers)] if args.layers else [])
    if random_cli.main([str(work / "model"), *mk]) != 0:
        return 2
    raw = json.loads((work / "model" / "config.json").read_text())
    if args.yarn:  # as a model card tells users to extend the context: the rope block and the positions
        raw["rope_scaling"] = {"rope_type": "yarn", "factor": args.yarn,
                               "original_max_position_embeddings": args.yarn_original}
        raw["max_position_embeddings"] = max(raw.get("max_position_embeddings", 0), args.max_context)
        (work / "model" / "config.json").write_text(json.dumps(raw, indent=1) + "\n")
    doc: dict = {"kind": "engine_bench_long_context", "config": Path(args.config).name,
                 "layers": raw["num_hidden_layers"], "devices": args.devices, "dtype": args.dtype,
                 "max_context": args.max_context, "tokens": args.tokens,
                 "rope_scaling": raw.get("rope_scaling"), "method": __doc__.strip()}

    def emit():
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    t0 = time.perf_counter()
    sampler = MemorySampler(_gpu_indices(args.devices)).__enter__()
    proc, port, doc["serve_command"], log = start_serve(work, args.devices, args.dtype, args.max_context)
    try:
        doc["health_start"] = wait_healthy(port, proc, 600)
        doc["start_s"] = round(time.perf_counter() - t0, 1)
        emit()
        v = min(30000, raw["vocab_size"] - 10)
        n_prompt = args.max_context - args.tokens
        prompt = [(7 * i + 3) % v + 10 for i in range(n_prompt)]
        body = {"model": "bench", "prompt": prompt, "max_tokens": args.tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        s = stream_gaps(port, body, timeout_s=args.timeout_s)
        doc["prompt_tokens"] = n_prompt
        doc["last_position"] = n_prompt + min(s["events"], args.tokens) - 1  # 0-based: the context's last
        doc["ttft_s"] = round(s["first_event_ms"] / 1e3, 2) if s["first_event_ms"] is not None else None
        doc["stream"] = {k: s[k] for k in ("events", "gap_ms_median", "gap_ms_p90", "gap_ms_max")}
        doc["completed"] = s["events"] >= args.tokens
        status, text = _request(port, "/health", timeout=10)
        doc["health_end"] = json.loads(text) if status == 200 else {"status": status}
    except Exception as e:  # noqa: BLE001 - a failed phase is a result; the log says why
        doc["error"] = f"{type(e).__name__}: {e}"
    finally:
        sampler.__exit__()
        doc["gpu_memory_used_mib"] = sampler.result()  # the peak while serving: weights, K/V, workspace
        end_serve(proc, log, work, doc, emit, remove=True)
    print(json.dumps(doc, indent=1))
    return 0 if doc.get("completed") else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
