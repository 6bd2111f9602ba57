"""The service's settings: one frozen record built from `python -m engine serve` flags.

Stdlib only, so `supervise` can build the same command line without importing the
serving stack. Every check a user can fail raises ServeConfigError with the reason.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from engine import dtype_rule  # stdlib-only
from engine.allreduce.paths import ALLREDUCE_CHOICES as ALLREDUCE_PATHS  # stdlib-only, like this module
from engine.core import speculative  # stdlib-only too
from engine.core.config import files_dir  # stdlib-only too
from engine.service import concurrency_default  # stdlib-only too
from engine.service.concurrency_default import MAX_CONCURRENCY

# serve's exit codes that no restart mends: bad flags or model (2), a host that cannot serve (4: an extra
# or CUDA missing). Its supervisors (supervisord, systemd) leave such an exit down and say so.
EXIT_BAD_INPUT = 2
EXIT_CANNOT_SERVE = 4
FINAL_EXITS = (EXIT_BAD_INPUT, EXIT_CANNOT_SERVE)

DTYPES = ("float32", "float16", "bfloat16")

# The service's watchdog limits: the one set `serve`, `supervise`, `deploy` and `qualify` run with
# (deploy and qualify pass none of these flags). docs/acceptance.md has the recovery times they give.
#
# docs/field-figures.md, "How the two-process engine stayed safe": a request whose progress
# counter does not move for 180 s is treated as stalled.
DEFAULT_STALL_TIMEOUT_S = 180.0
# A rank sends a heartbeat every HEARTBEAT_INTERVAL_S from a thread of its own; this much silence (or
# this long waiting for its peer in one allreduce) ends the pair. Five heartbeats: the longest gap the
# proxy saw between two heartbeats of busy ranks on a 2-core CPU host at load average 10 was 0.87 s
# (/health max_heartbeat_gap_s, docs/acceptance.md), and 2.5 s keeps a frozen rank's recovery within 5 s.
DEFAULT_LIVENESS_TIMEOUT_S = 2.5
HEARTBEAT_INTERVAL_S = 0.5
# An allreduce that waits this long for the peer fails the rank (the heartbeat finds a stalled peer
# long before: this is the backstop for a rank whose heartbeat thread still runs).
DEFAULT_ALLREDUCE_TIMEOUT_S = 60.0
# Consecutive failed rank starts before serve gives up and exits 3 (its supervisor then starts it afresh).
DEFAULT_MAX_RESTARTS = 3
DEFAULT_START_TIMEOUT_S = 600.0
# The request body limit's default scales with the context (a 256K-token prompt is ~1.8 MB of token ids).
BODY_BYTES_PER_TOKEN = 16
MIN_BODY_LIMIT_BYTES = 1 << 20
SERVICE_LOG = "service.log"  # the structured log's file in the state directory, unless --log-file


class ServeConfigError(Exception):
    """A serve flag that cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class ServeConfig:
    model_dir: str
    tp: int
    host: str
    port: int
    api_key: str | None               # read from --api-key-file; never printed or logged
    allreduce: str
    max_context: int | None           # None: the model's native context, bounded by the card (context_default.py)
    queue_cap: int                    # requests allowed to WAIT behind the running one(s)
    stall_timeout_s: float
    max_restarts: int                 # consecutive failed rank starts before serve exits non-zero
    enable_fault_injection: bool
    devices: tuple[str, str]          # rank 0's and rank 1's torch device
    dtype: str
    state_dir: str
    served_model_name: str | None     # None: from the model directory (see proxy_text.served_model_id)
    body_limit_bytes: int
    start_timeout_s: float
    allreduce_timeout_s: float | None
    ping_interval_s: float
    log_file: str                     # the structured log's file (default: STATE_DIR/service.log)
    liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S
    drain_timeout_s: float = 10.0      # SIGTERM/SIGINT: how long running requests may finish
    header_timeout_s: float = 10.0     # a request's headers must arrive within this
    body_timeout_s: float = 30.0       # ... and its body within this after the headers
    keep_alive_timeout_s: float = 5.0  # an idle kept-alive connection is closed after this
    max_connections: int = 256         # open client connections; beyond: an idle one is closed, else 503
    text_workers: int = 2              # processes that tokenize prompts (never the event loop)
    text_jobs_per_client: int | None = None  # one client's prompts in those workers at once (None: the served N,
    # at least 2); beyond: 429
    standby_ranks: bool = True         # fork restarts' ranks from a process that imported torch once
    kv_cache_dtype: str = "auto"       # auto: the model's dtype; int8: engine.core.kvquant
    no_prefix_cache: bool = False      # True: every prompt prefilled from its first token
    batch_graphs: bool = True          # N > 1 replays the batched step from CUDA graphs (batch_graphs.py); False: eager
    draft_tokens: int = 0              # MTP drafts per round (--speculative mtp --draft-tokens K); 0: off
    chat_template: str | None = None   # --chat-template FILE (absolute): wins over the model's own template
    reasoning_parser: str = "auto"     # qwen3: reasoning apart (reasoning_content); none: inline; auto: by vocabulary
    no_vision: bool = False            # True: the ranks do not load the vision tower; images are refused
    allow_image_urls: bool = False     # True: image_url parts may name http(s) URLs the proxy fetches
    max_images: int = 4                # image parts per request
    max_image_pixels: int = 16_777_216  # width x height of one image (engine.service.images)
    max_concurrency: int | None = 1    # sequence slots per rank; above 1: continuous batching (rank_batch.py);
                                       # None: each GPU rank chooses it from memory (concurrency_default.py)
    concurrency_bound: str = "flag"    # what chose max_concurrency: concurrency_default.BOUNDS
    concurrency_why: str = ""          # ... and why, in a sentence (/health's concurrency)

    @property
    def is_loopback(self) -> bool:
        return host_is_loopback(self.host)

    @property
    def gpu(self) -> bool:
        """A rank runs on a CUDA device."""
        return any(d.startswith("cuda") for d in self.devices)


def host_is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname other than localhost may resolve anywhere


def parse_devices(text: str) -> tuple[str, str]:
    """`cpu` -> both ranks on CPU; `cuda` -> rank r on cuda:r; `cuda:0,cuda:0` -> as listed."""
    text = text.strip()
    if text == "cpu":
        return ("cpu", "cpu")
    if text == "cuda":
        return ("cuda:0", "cuda:1")
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(p == "cpu" or p.startswith("cuda:") for p in parts):
        raise ServeConfigError(
            f"--device {text!r}: give cpu, cuda (rank r on cuda:r) or two devices such as cuda:0,cuda:0"
        )
    return (parts[0], parts[1])


def default_state_dir(port: int = 8000) -> str:
    """One directory per instance (its port), so two services of one user never share sockets,
    logs or generation numbers."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "v100plan-engine", f"port-{port}")


def read_api_key(path: str) -> str:
    """The key in `path`; refused when the file can be read by its group or by others."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ServeConfigError(f"--api-key-file {path}: cannot read it ({exc.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if mode & 0o077:
            raise ServeConfigError(
                f"--api-key-file {path} is readable by other users (mode {mode & 0o777:04o}): "
                f"run `chmod 600 {path}` and start again")
        with os.fdopen(fd, "r", closefd=False) as fh:
            key = fh.read().strip()
    finally:
        os.close(fd)
    if not key:
        raise ServeConfigError(f"--api-key-file {path} is empty")
    return key


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (Hugging Face layout), unsharded or "
                        "written by `python -m engine shard` (shard.json, rank0/, rank1/)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (the service runs 2; default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs --api-key-file; default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="the proxy's HTTP port (default: %(default)s)")
    parser.add_argument("--api-key-file", help="file holding the API key clients send as 'Bearer KEY' (mode 600; default: none, "
                        "no key asked on loopback)")
    parser.add_argument("--allreduce", choices=ALLREDUCE_PATHS, default="auto",
                        help="allreduce path (default: %(default)s, the start-up self-test and race choose)")
    parser.add_argument("--max-context", type=int, help="prompt + completion tokens per request (default: the model's native context, on a GPU "
                        "bounded by what fits the card; /health's context says which)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                        help="the K/V cache: auto = the model's dtype; int8 = one scale per position and head, "
                             "half the bytes (default: auto)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="prefill every prompt from its first token (default: a prompt that starts with what the "
                             "ranks last processed prefills only the rest; usage.prompt_tokens_details.cached_tokens)")
    speculative.add_arguments(parser)
    parser.add_argument("--no-vision", action="store_true",
                        help="do not load a multimodal checkpoint's vision tower (frees its memory; images are refused; "
                             "default: loaded when the checkpoint has one)")
    parser.add_argument("--allow-image-urls", action="store_true",
                        help="fetch http(s) image URLs (the proxy then reaches any URL a client names; default: off, only "
                             "inline data: URIs)")
    parser.add_argument("--max-images", type=int, default=4, help="image parts per request (default: %(default)s)")
    parser.add_argument("--max-image-pixels", type=int, default=16_777_216,
                        help="width x height of one image, checked from its header before decoding (default: %(default)s)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help=f"requests decoded at once, 1-{MAX_CONCURRENCY} (each rank holds that many sequence "
                             "slots; above 1 the plain torch decode runs them together, docs/service.md "
                             "'Concurrent requests'; default: 1 with --speculative mtp or "
                             "on CPU, else as many sequences of the served context as fit the card beside the "
                             f"weights, at most {MAX_CONCURRENCY}; /health's concurrency says which)")
    parser.add_argument("--no-batch-graphs", dest="batch_graphs", action="store_false",
                        help="with --max-concurrency above 1, launch the batched step eagerly instead of replaying "
                             "it from CUDA graphs per row bucket and window (engine/service/batch_graphs.py; the "
                             "default on GPUs whose decoder runs graphs: fewer start-up captures, slower steps)")
    parser.add_argument("--queue-cap", type=int, default=16, help="requests that may wait (beyond: 429; default: %(default)s)")
    parser.add_argument("--stall-timeout-s", type=float, default=DEFAULT_STALL_TIMEOUT_S,
                        help="a rank making no progress this long during a request (or not answering an "
                             "idle ping) ends the pair (default: %(default)s)")
    parser.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                        help="consecutive failed rank starts before serve exits non-zero (default: %(default)s)")
    parser.add_argument("--enable-fault-injection", action="store_true",
                        help="expose /control/* on loopback (with the API key: needs --api-key-file) and pass "
                             "the fault hooks to the ranks (default: off)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, or two devices such as cuda:0,cuda:0 (default: %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="weights and activations (default: engine.dtype_rule: float32 on CPU, bfloat16 from "
                             "compute capability 8.0, float16 before)")
    parser.add_argument("--state-dir", default=None, help="sockets, rank logs and service.json (default: $XDG_STATE_HOME or ~/.local/state, then "
                        "v100plan-engine/port-PORT)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name /v1/models lists (default: the model directory's name)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a jinja chat template to use instead of the model's (chat_template.jinja or "
                             "tokenizer_config.json's); rendered sandboxed (default: the model's)")
    parser.add_argument("--reasoning-parser", default="auto", choices=("auto", "qwen3", "none"),
                        help="qwen3: a thinking model's <think>...</think> text is returned apart, as "
                             "reasoning_content; none: left inline in content; auto: qwen3 when the vocabulary "
                             "has </think> (default: %(default)s)")
    parser.add_argument("--body-limit-bytes", type=int, default=None,
                        help=f"largest request body; a larger one is answered 413 (default: {BODY_BYTES_PER_TOKEN} "
                             f"bytes per context position, so a prompt filling --max-context fits; at least "
                             f"{MIN_BODY_LIMIT_BYTES})")
    parser.add_argument("--start-timeout-s", type=float, default=DEFAULT_START_TIMEOUT_S,
                        help="both ranks must be ready within this (default: %(default)s)")
    parser.add_argument("--allreduce-timeout-s", type=float, default=DEFAULT_ALLREDUCE_TIMEOUT_S,
                        help="an allreduce waiting this long for the peer fails its rank (default: %(default)s)")
    parser.add_argument("--ping-interval-s", type=float, default=None,
                        help="idle liveness ping period (default: a quarter of the stall timeout, at most 10 s)")
    parser.add_argument("--log-file", default=None, help="where the structured log lines are appended besides "
                        "stderr (default: service.log in the state directory)")
    parser.add_argument("--liveness-timeout-s", type=float, default=DEFAULT_LIVENESS_TIMEOUT_S,
                        help="a rank silent this long (no heartbeat), or waiting this long for its peer in "
                             "one allreduce, ends the pair; 0: no heartbeat check (default: %(default)s)")
    parser.add_argument("--drain-timeout-s", type=float, default=10.0,
                        help="on SIGTERM/SIGINT, how long running requests may finish before they get 503 "
                             "(default: %(default)s)")
    parser.add_argument("--header-timeout-s", type=float, default=10.0,
                        help="a client must send its request headers within this (default: %(default)s)")
    parser.add_argument("--body-timeout-s", type=float, default=30.0,
                        help="... and the request body within this after the headers (default: %(default)s)")
    parser.add_argument("--keep-alive-timeout-s", type=float, default=5.0,
                        help="idle kept-alive connections are closed after this (default: %(default)s)")
    parser.add_argument("--no-standby-ranks", dest="standby_ranks", action="store_false",
                        help="start every generation's ranks as new processes, without the fork server that "
                             "keeps torch imported for them (it costs host memory for torch, no GPU memory; "
                             "default: the fork server is used)")
    parser.add_argument("--max-connections", type=int, default=256,
                        help="open client connections; one more closes the oldest idle connection of the client "
                             "holding most (never one that showed the API key), else it is answered 503 "
                             "(default: %(default)s)")
    parser.add_argument("--text-workers", type=int, default=2,
                        help="worker processes that tokenize prompts and render chat templates, off the event "
                             "loop that watches the ranks (default: %(default)s)")
    parser.add_argument("--text-jobs-per-client", type=int, default=None,
                        help="prompts of one client (its address, and whether it sent the API key) in those "
                             "workers at once; one more is answered 429 (default: the served concurrency, at "
                             "least 2, so one client can fill every slot)")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    if args.tp != 2:
        raise ServeConfigError(f"--tp {args.tp}: the service runs exactly two ranks (--tp 2); "
                               "use `python -m engine generate --tp 1` for one process")
    model = Path(args.model)
    if not (files_dir(model) / "config.json").is_file():  # a shard directory: rank0/config.json
        raise ServeConfigError(f"--model {args.model}: no config.json there (expected a Hugging Face model directory)")
    api_key = read_api_key(args.api_key_file) if args.api_key_file else None
    if not host_is_loopback(args.host) and api_key is None:
        raise ServeConfigError(
            f"--host {args.host} is not a loopback address: refusing to serve it without --api-key-file"
        )
    if args.enable_fault_injection and api_key is None:
        raise ServeConfigError("--enable-fault-injection needs --api-key-file: without a key every local user "
                               "could kill or freeze the ranks through /control/inject")
    for name in ("queue_cap", "max_restarts"):
        if getattr(args, name) < 0:
            raise ServeConfigError(f"--{name.replace('_', '-')} must be 0 or more")
    why = concurrency_problem(args.max_concurrency) if args.max_concurrency is not None else None
    if why:
        raise ServeConfigError(why)
    if args.max_context is not None and args.max_context < 2:
        raise ServeConfigError("--max-context must be at least 2 tokens")
    if args.stall_timeout_s <= 0 or args.start_timeout_s <= 0:
        raise ServeConfigError("timeouts must be positive")
    for name in ("drain_timeout_s", "header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
        if getattr(args, name) <= 0:
            raise ServeConfigError(f"--{name.replace('_', '-')} must be positive")
    if args.liveness_timeout_s < 0:
        raise ServeConfigError("--liveness-timeout-s must be 0 (off) or positive")
    if args.liveness_timeout_s and args.liveness_timeout_s < 2 * HEARTBEAT_INTERVAL_S:
        raise ServeConfigError(f"--liveness-timeout-s must be at least {2 * HEARTBEAT_INTERVAL_S:g} s "
                               f"(two heartbeats) or 0")
    for name in ("max_connections", "text_workers", "text_jobs_per_client"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ServeConfigError(f"--{name.replace('_', '-')} must be 1 or more")
    if args.max_images < 0 or args.max_image_pixels < 1:
        raise ServeConfigError("--max-images must be 0 or more and --max-image-pixels 1 or more")
    devices = parse_devices(args.device)
    # engine.dtype_rule: float32 on CPU; on a GPU each rank applies it to its card ("auto")
    dtype = args.dtype or (dtype_rule.dtype_for(dtype_rule.CPU) if devices[0] == "cpu" else dtype_rule.AUTO)
    ping = args.ping_interval_s if args.ping_interval_s else min(10.0, args.stall_timeout_s / 4)
    # Never resolved: a symbolic link on the way is refused by the state directory's check, not followed.
    state_dir = os.path.abspath(os.path.expanduser(args.state_dir or default_state_dir(args.port)))
    # The served N where the flags decide it; None: each GPU rank chooses from its card's memory.
    slots = concurrency_default.before_ranks(args.max_concurrency, draft_tokens=_draft_tokens(args),
                                             gpu=any(d.startswith("cuda") for d in devices))
    computed = {
        "max_concurrency": slots["max_concurrency"] if slots else None,
        "concurrency_bound": slots["bound"] if slots else "memory",
        "concurrency_why": slots["why"] if slots else "each rank chooses it from its card's memory when it starts",
        "model_dir": str(model.resolve()),
        "api_key": api_key,
        "devices": devices,
        "dtype": dtype,
        "state_dir": state_dir,
        "ping_interval_s": ping,
        "log_file": args.log_file or os.path.join(state_dir, SERVICE_LOG),
        "draft_tokens": _draft_tokens(args),
        "chat_template": _chat_template(args.chat_template),
        # room for the images too (base64 of up to 20 MiB each: engine.service.images.ImageLimits.max_bytes)
        "body_limit_bytes": args.body_limit_bytes or body_limit_for(args.max_context or native_context(model))
        + (0 if args.no_vision else args.max_images * (28 << 20) * has_vision(model)),
    }
    # Every other field is the flag of the same name (a new field without one fails here, at once).
    flags = {f.name: getattr(args, f.name) for f in fields(ServeConfig) if f.name not in computed}
    return ServeConfig(**flags, **computed)


def native_context(model: Path) -> int:
    """The model config's max_position_embeddings (its text_config's for a multimodal wrapper); 0 if absent."""
    try:
        raw = json.loads((files_dir(model) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    raw = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    return int(raw.get("max_position_embeddings") or 0)


def has_vision(model: Path) -> bool:
    """The model config has a vision_config (a multimodal checkpoint with its tower)."""
    try:
        return isinstance(json.loads((files_dir(model) / "config.json").read_text()).get("vision_config"), dict)
    except (OSError, ValueError):
        return False


def body_limit_for(context: int) -> int:
    """The default request body limit: room for a prompt of ``context`` tokens as token ids (<= 7 bytes each) or as
    JSON text (about 4 characters a token, 6 bytes for an escaped non-ASCII one)."""
    return max(MIN_BODY_LIMIT_BYTES, BODY_BYTES_PER_TOKEN * context)


def _chat_template(path: str | None) -> str | None:
    """--chat-template FILE: readable and a template jinja2 compiles (checked here, not at the first request)."""
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ServeConfigError(f"--chat-template {path}: cannot read it ({e})") from None
    from engine.core import chat_template  # jinja2 is imported by the check, not by this module

    try:
        chat_template.check(text)
    except (chat_template.TemplateError, ImportError) as e:
        raise ServeConfigError(f"--chat-template {path}: {e}") from None
    return str(Path(path).resolve())


def _draft_tokens(args: argparse.Namespace) -> int:
    try:
        return speculative.draft_tokens(args)
    except ValueError as e:
        raise ServeConfigError(str(e)) from None


def concurrency_problem(n: int) -> str | None:
    """Why --max-concurrency ``n`` cannot be served, or None (every other flag runs with any N: MTP speculation
    per slot, engine/service/rank_batch_spec.py)."""
    if not 1 <= n <= MAX_CONCURRENCY:
        return f"--max-concurrency must be between 1 and {MAX_CONCURRENCY}, not {n}"
    return None


def rank_command(cfg: ServeConfig, rank: int, generation: int, rendezvous: str, socket_path: str,
                 extra: tuple[str, ...] = ()) -> list[str]:
    """The `python -m engine rank ...` line for one rank (docs/engine.md, rank <-> proxy protocol).

    `extra`: further rank flags, e.g. the fault hook that fails this start's self-test."""
    cmd = [
        sys.executable, "-m", "engine", "rank",
        "--model", cfg.model_dir,
        "--rank", str(rank), "--world", "2",
        "--rendezvous", rendezvous,
        "--control-socket", socket_path,
        "--device", cfg.devices[rank],
        "--dtype", cfg.dtype,
        "--allreduce", cfg.allreduce,
        "--generation", str(generation),
        "--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S),
    ]
    if cfg.max_context is not None:
        cmd += ["--max-context", str(cfg.max_context)]
    if ((cfg.max_context is None or cfg.max_concurrency is None) and cfg.devices[0] == cfg.devices[1]
            and cfg.gpu):  # both ranks on one card: each plans on half of it
        cmd += ["--card-share", "0.5"]
    if cfg.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", cfg.kv_cache_dtype]
    if cfg.no_prefix_cache:
        cmd.append("--no-prefix-cache")
    if not cfg.batch_graphs:
        cmd.append("--no-batch-graphs")
    if cfg.no_vision:
        cmd.append("--no-vision")
    if cfg.draft_tokens:
        cmd += ["--speculative", "mtp", "--draft-tokens", str(cfg.draft_tokens)]
    if cfg.max_concurrency is None:  # the rank chooses from memory (a restart's pinned N follows in `extra`)
        cmd += ["--max-concurrency", "memory"]
    elif cfg.max_concurrency > 1:
        cmd += ["--max-concurrency", str(cfg.max_concurrency)]
    if cfg.enable_fault_injection:
        cmd.append("--enable-fault-injection")
    cmd += ["--allreduce-timeout-s", str(cfg.allreduce_timeout_s or DEFAULT_ALLREDUCE_TIMEOUT_S)]
    return cmd + list(extra)


def service_limits(cfg: ServeConfig) -> dict[str, float | int]:
    """The watchdog limits in force (keyed /health; the acceptance report records them)."""
    return {"liveness_timeout_s": cfg.liveness_timeout_s, "heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
            "stall_timeout_s": cfg.stall_timeout_s, "allreduce_timeout_s": cfg.allreduce_timeout_s
            or DEFAULT_ALLREDUCE_TIMEOUT_S, "max_restarts": cfg.max_restarts, "start_timeout_s": cfg.start_timeout_s}
