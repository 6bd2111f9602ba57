"""`python -m engine.bench.served`: the service's own decode speed against the bench's step, in ONE run.

  1. `python -m engine bench-tp2` on the same shape (one context, the captured paths, the served loop):
     the TP2 and TP1 graph steps the engine's figures come from;
  2. a random-weight checkpoint of that shape written to disk, then `python -m engine serve --tp 2`
     on it, as a user starts it, on 127.0.0.1;
  3. /v1/completions with a --prompt-tokens prompt given as token ids: --short and --long generated
     tokens (ignore_eos), 3 of each after a warm-up; served ms/token = (median long - median short) /
     (long - short), so prefill and the HTTP round trip cancel out;
  4. one streamed request of --long tokens: the arrival time of every SSE event, and the gaps;
  5. the ratios, each from figures of this run: served TP2 vs the bench's TP2 graph step, TP2 vs TP1.
Prints one JSON document (also written to --out). Needs two CUDA GPUs (or --devices cuda:0,cuda:0).
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine import BUNDLE_ROOT, DATA_DIR

DATA = DATA_DIR
REPO = BUNDLE_ROOT


def write_random_checkpoint(config_path: str, dst: Path, dtype: str, device: str) -> dict:
    """config.json + random bf16/fp16 safetensors (one file per 8 layers), generated on the GPU."""
    import torch
    from safetensors.torch import save_file

    from engine.core import config as ecfg
    from engine.core import random_weights

    t0 = time.perf_counter()
    raw = json.loads(Path(config_path).read_text())
    cfg = ecfg.from_dict(raw)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(raw))
    g = torch.Generator(device=device).manual_seed(11)
    dt = getattr(torch, dtype)
    part: dict = {}
    nbytes, n_file = 0, 0

    def flush():
        nonlocal part, n_file
        if part:
            save_file(part, str(dst / f"model-{n_file:05d}.safetensors"))
            n_file += 1
            part = {}

    for name, shape in random_weights.hf_shapes(cfg):
        t = random_weights.value(name, shape, cfg, dt, device, g).cpu()
        part[name] = t
        nbytes += t.numel() * t.element_size()
        if name.endswith("down_proj.weight") and int(name.split(".")[2]) % 8 == 7:  # one file per 8 layers
            flush()
    flush()
    return {"bytes": nbytes, "files": n_file, "seconds": round(time.perf_counter() - t0, 1)}


def start_serve(work: Path, devices: str, dtype: str, max_context: int, model_dir: Path | None = None,
                extra: list[str] | None = None) -> tuple[subprocess.Popen, int, str, object]:
    """`python -m engine serve --tp 2` on work/model (or ``model_dir``) as a user starts it (127.0.0.1, a free port,
    NVLink multicast off, long start and stall limits for long prompts; ``extra``: more serve flags), its log in
    work/serve.log: (process, port, command, log)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    port = free_port()
    cmd = [sys.executable, "-m", "engine", "serve", "--model", str(model_dir or work / "model"), "--tp", "2",
           "--port", str(port), "--device", devices, "--dtype", dtype, "--max-context", str(max_context),
           "--state-dir", str(work / "state"), "--served-model-name", "bench", "--start-timeout-s", "600",
           "--stall-timeout-s", "900", *(extra or [])]
    log = open(work / "serve.log", "wb")
    proc = subprocess.Popen(cmd, cwd=BUNDLE_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, port, " ".join(cmd[1:]), log


def stop_serve(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (serve drains and stops its ranks), SIGKILL past ``timeout_s``."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def end_serve(proc: subprocess.Popen, log, work: Path, doc: dict, emit, remove: bool) -> None:
    """The service benches' ending: stop_serve (60 s), the last 20 lines of work/serve.log in doc["log_tail"],
    emit(), and work removed when ``remove`` (a temporary random checkpoint is gigabytes: it goes with the run)."""
    try:
        stop_serve(proc, 60)
    finally:
        log.close()
    doc["log_tail"] = (work / "serve.log").read_text(errors="replace").splitlines()[-20:]
    emit()
    if remove:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(port: int, path: str, body: dict | None = None, timeout: float = 600.0) -> tuple[int, str]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if body is None:
            c.request("GET", path)
        else:
            c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode} before it was healthy")
        try:
            status, text = _request(port, "/health", timeout=5)
            if status == 200:
                return json.loads(text)
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"serve was not healthy within {timeout_s} s")


def complete(port: int, model: str, prompt: list[int], n: int, stream: bool = False) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}


def timed(port: int, body: dict) -> tuple[float, dict]:
    t = time.perf_counter()
    status, text = _request(port, "/v1/completions", body)
    dt = time.perf_counter() - t
    if status != 200:
        raise RuntimeError(f"/v1/completions answered {status}: {text[:300]}")
    return dt, json.loads(text)


def stream_gaps(port: int, body: dict, timeout_s: float = 600, on_event=None, t0: float | None = None) -> dict:
    """Arrival time (ms after ``t0``, default the request) of every SSE data event with a token, and their gaps;
    ``on_event(arrivals)`` is called after each event arrives."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    t0 = time.perf_counter() if t0 is None else t0
    c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"/v1/completions answered {r.status}: {r.read()[:300]!r}")
    arrivals, events, buf = [], 0, b""
    while True:
        chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
        if not chunk:
            break
        now = (time.perf_counter() - t0) * 1e3
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            line = ev.decode(errors="replace").strip()
            if line.startswith("data: {"):
                events += 1
                arrivals.append(round(now, 3))
                if on_event is not None:
                    on_event(arrivals)
    c.close()
    gaps = [round(b - a, 3) for a, b in zip(arrivals, arrivals[1:])]
    q = sorted(gaps)
    return {"events": events, "first_event_ms": arrivals[0] if arrivals else None,
            "gap_ms_median": round(statistics.median(gaps), 3) if gaps else None,
            "gap_ms_p90": q[int(0.9 * (len(q) - 1))] if q else None, "gap_ms_max": max(gaps) if gaps else None,
            "arrivals_ms": arrivals}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.served", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DATA / "qwen3-8b.config.json"))
    p.add_argument("--devices", default="cuda:0,cuda:1")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--short", type=int, default=16)
    p.add_argument("--long", type=int, default=144)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--bench-json", default=None, help="a bench-tp2 result of this run already made (skip step 1)")
    p.add_argument("--start-timeout-s", type=float, default=420.0)
    p.add_argument("--workdir", default=None, help="where the random checkpoint goes (default: a temp dir)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    doc: dict = {"kind": "engine_bench_served",
                 "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "config": Path(args.config).name, "devices": args.devices, "dtype": args.dtype,
                 "prompt_tokens": args.prompt_tokens, "short": args.short, "long": args.long,
                 "max_context": args.max_context,
                 "method": ("served ms/token = (median of 3 long - median of 3 short non-streamed completions) / "
                            "(long - short), after one warm-up; SSE gaps from one streamed completion; the bench "
                            "step from `python -m engine bench-tp2` run first in this same command")}

    def emit():
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="v100plan-served-"))
    work.mkdir(parents=True, exist_ok=True)
    # 1. the bench's step (and the served loop in-process), same shape, same run
    if args.bench_json:
        bench = json.loads(Path(args.bench_json).read_text())
    else:
        out = work / "bench-tp2.json"
        subprocess.run([sys.executable, "-m", "engine", "bench-tp2", "--config", args.config, "--contexts", "1024",
                        "--paths", "nccl,device_mailbox_graph", "--eager-steps", "5", "--iters", "100", "--timeout-s", "300",
                        "--served", f"{args.prompt_tokens},{args.short},{args.long}", "--out", str(out)],
                       cwd=REPO, env=env, stdout=subprocess.DEVNULL, timeout=600)
        bench = json.loads(out.read_text()) if out.exists() else {}
    doc["bench_summary"] = bench.get("summary")
    emit()
    # 2. a random checkpoint, then the service as a user starts it
    import torch

    model_dir = work / "model"
    doc["checkpoint"] = write_random_checkpoint(args.config, model_dir, args.dtype, args.devices.split(",")[0])
    torch.cuda.empty_cache()
    emit()
    port = free_port()
    state = work / "state"
    log_path = work / "serve.log"
    cmd = [sys.executable, "-m", "engine", "serve", "--model", str(model_dir), "--tp", "2", "--port", str(port),
           "--device", args.devices, "--dtype", args.dtype, "--max-context", str(args.max_context),
           "--state-dir", str(state), "--served-model-name", "bench", "--start-timeout-s", str(args.start_timeout_s)]
    doc["serve_command"] = " ".join(cmd[1:])
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            doc["health"] = wait_healthy(port, proc, args.start_timeout_s)
            doc["start_s"] = round(time.perf_counter() - t0, 1)
            emit()
            prompt = [(7 * i + 3) % 32000 + 10 for i in range(args.prompt_tokens)]
            timed(port, complete(port, "bench", prompt, args.short))  # warm-up
            shorts, longs, ntok = [], [], None
            for _ in range(3):
                shorts.append(timed(port, complete(port, "bench", prompt, args.short))[0])
                dt, body = timed(port, complete(port, "bench", prompt, args.long))
                longs.append(dt)
                ntok = body.get("usage", {}).get("completion_tokens")
            ms = (statistics.median(longs) - statistics.median(shorts)) * 1e3 / (args.long - args.short)
            doc["served"] = {"ms_per_token": round(ms, 4), "tok_s": round(1000 / ms, 2),
                             "short_s": [round(x, 4) for x in shorts], "long_s": [round(x, 4) for x in longs],
                             "long_completion_tokens": ntok}
            emit()
            doc["stream"] = stream_gaps(port, complete(port, "bench", prompt, args.long, stream=True))
            status, metrics = _request(port, "/metrics")
            doc["metrics"] = [ln for ln in metrics.splitlines() if ln and not ln.startswith("#")][:80]
        except Exception as e:  # noqa: BLE001 - a failed phase is a result; the log says why
            doc["error"] = f"{type(e).__name__}: {e}"
        finally:
            stop_serve(proc, 30)
    text = log_path.read_text(errors="replace")
    rank_lines = [ln for f in sorted((state / "logs").glob("rank*.log")) for ln in f.read_text(errors="replace").splitlines()]
    doc["rank_log"] = [ln for ln in rank_lines if "decode" in ln or "allreduce" in ln][-16:]
    doc["log_tail"] = text.splitlines()[-30:]
    # 5. the ratios, each from this run
    s = doc.get("bench_summary") or {}
    served = (doc.get("served") or {}).get("ms_per_token")
    picked = (doc.get("health") or {}).get("allreduce")
    step = (s.get(picked) or {}).get("step_ms") if picked else None
    tp1 = (s.get("tp1") or {}).get("step_ms")
    tp1_served = (s.get("tp1") or {}).get("served_ms_per_token")  # runner loop, one card, same run
    doc["ratios"] = {"allreduce": picked, "served_ms_per_token": served, "bench_tp2_step_ms": step,
                     "served_vs_bench": round(step / served, 4) if step and served else None,
                     "bench_tp1_step_ms": tp1, "tp1_served_ms_per_token": tp1_served,
                     "tp2_vs_tp1_served": round(tp1_served / served, 4) if tp1_served and served else None,
                     "tp2_vs_tp1_bench": round(tp1 / step, 4) if tp1 and step else None}
    doc["wall_s"] = round(time.perf_counter() - t_start, 1)
    emit()
    print(json.dumps(doc, indent=1))
    return 0 if "error" not in doc and served else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
