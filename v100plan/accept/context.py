"""What the cases share: the target, the options, the HTTP client, reference answers and the
service-state helpers (health, waiting for a new rank generation)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from v100plan.accept.http import Answer, Client

# Prompts with known answers. Short, so a CPU demo model answers them in well under a second.
PROMPTS = {
    "fox": "The quick brown fox",
    "once": "Once upon a time",
    "begin": "In the beginning",
    "story": "Long story",
}
REF_TOKENS = 16


@dataclasses.dataclass
class Target:
    """The service under test and what the suite may do to it."""

    endpoint: str
    api_key: str | None = None
    mode: str = "endpoint"                         # local | endpoint | host
    host: str | None = None
    model: str | None = None                       # None: the first model /v1/models lists
    model_dir: str | None = None                   # weights on this machine: TP1 references by the engine
    engine: dict[str, Any] | None = None           # launch settings: tp, devices, dtype, allreduce, max_context
    supervised: bool = False                       # a supervisor restarts the proxy when it dies
    read_rank_logs: Callable[[], dict[int, str]] | None = None
    read_service_log: Callable[[], str] | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class AcceptOptions:
    clients: int = 16
    requests: int = 200
    fault_repeats: int = 3
    only: tuple[str, ...] = ()                     # keys or groups to run; empty: all
    skip: tuple[str, ...] = ()                     # keys or groups to waive (reason: skipped by the user)
    load_max_tokens: int = 8
    recover_timeout_s: float = 90.0


@dataclasses.dataclass
class Reference:
    text: str
    token_ids: list[int] | None
    source: str
    tokens: int | None = None      # how many tokens the answer has


class References:
    """Reference answers: the engine's own TP1 run on the same weights when they are here, else the
    service's first greedy answer taken while nothing else runs (then only consistency is judged)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._cache: dict[tuple, Reference] = {}
        self._lock = threading.Lock()

    @property
    def exact(self) -> bool:
        """True when answers can be checked token for token against a TP1 run here: the weights are
        here and the service computes in float32 (in half precision TP2's split sums round differently
        from one card's, so a flipped near-tie is not a wrong answer)."""
        return self.ctx.target.model_dir is not None and self.half_precision is None

    @property
    def half_precision(self) -> str | None:
        dtype = (self.ctx.target.engine or {}).get("dtype")
        return dtype if dtype in ("float16", "bfloat16") else None

    def get(self, prompt: str, max_tokens: int = REF_TOKENS, temperature: float = 0.0,
            seed: int | None = None) -> Reference:
        key = (prompt, max_tokens, temperature, seed)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        ref = self._engine_tp1([key])[0] if self.exact else self._baseline(*key)
        with self._lock:
            self._cache[key] = ref
        return ref

    def prefetch(self, keys: list[tuple]) -> None:
        """Compute several references at once: one engine process and one model load for all of them
        (with local weights), else one baseline request each."""
        keys = [(k + (0.0, None))[:4] for k in keys]
        if not self.exact:
            for k in keys:
                self.get(*k)
            return
        refs = self._engine_tp1(keys)
        with self._lock:
            self._cache.update(zip(keys, refs))

    def _engine_tp1(self, keys: list[tuple]) -> list[Reference]:
        eng = self.ctx.target.engine or {}
        from v100plan.accept.serving import served_draft_tokens

        # A sampled answer of a speculating service follows the rejection rule's draws: its reference is a TP1
        # run speculating with the same drafts. Greedy references never speculate (greedy is lossless, so a
        # speculating service must give one-token decoding's answers).
        drafts = served_draft_tokens(self.ctx) if any(k[2] for k in keys) else 0
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as fh:
            for prompt, max_tokens, temperature, seed in keys:
                fh.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                                     "seed": seed, **({"draft_tokens": drafts} if temperature and drafts else {})})
                         + "\n")
        cmd = [sys.executable, "-m", "engine", "generate", "--model", self.ctx.target.model_dir, "--tp", "1",
               "--batch", fh.name, "--device", (eng.get("devices") or ["cpu"])[0]]
        if eng.get("dtype"):
            cmd += ["--dtype", eng["dtype"]]
        if self.ctx.max_context:  # the served context limit: the same cache size, so the same decode windows
            cmd += ["--max-context", str(self.ctx.max_context)]
        # On a CPU one thread: torch's default of one per core spins in OpenMP whenever another process takes
        # a core (1024 tokens of the demo: 25 s with one thread, over 120 s with two, at load average 8).
        on_cpu = (eng.get("devices") or ["cpu"])[0] == "cpu"
        env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if on_cpu else {})}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        finally:
            os.unlink(fh.name)
        if proc.returncode != 0:
            raise RuntimeError(f"the TP1 reference run failed (exit {proc.returncode}): {proc.stderr[-500:]}")
        docs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if len(docs) != len(keys):
            raise RuntimeError(f"the TP1 reference run answered {len(docs)} of {len(keys)} requests")
        return [Reference(d["text"], list(d["token_ids"]), "python -m engine generate --tp 1 on the same weights",
                          len(d["token_ids"])) for d in docs]

    def _baseline(self, prompt, max_tokens, temperature, seed) -> Reference:
        payload = self.ctx.payload(prompt, max_tokens, temperature=temperature, seed=seed)
        a = self.ctx.client.post("/v1/completions", payload)
        if not a.ok:
            raise RuntimeError(f"the baseline request answered {a.status}: {a.error_message()}")
        return Reference(a.text(), a.token_ids(), "the service's own first answer (no local weights to compare)",
                         (a.body.get("usage") or {}).get("completion_tokens"))


# what the report keeps of each rank's /health "decode" (no figures: those belong to the load and speed runs)
DECODE_FIELDS = ("mode", "kernels", "allreduce", "exchange", "lockstep", "windows", "prefix_cache")


class Context:
    def __init__(self, target: Target, options: AcceptOptions, plan: dict | None = None,
                 probe: dict | None = None):
        self.target = target
        self.options = options
        self.plan = plan
        self.probe = probe
        self.client = Client(target.endpoint, target.api_key)
        self.model: str = target.model or ""
        self.max_context: int | None = (target.engine or {}).get("max_context")
        self.is_engine = False             # the bundled engine answers (its v100plan extension)
        self.fault_control = False         # its /control routes answer
        self.server: str | None = None
        self.decode: dict | None = None    # the engine's ranks: how they decode (its keyed /health)
        self.limits: dict | None = None    # the engine's watchdog limits in force (its keyed /health)
        self.speculation: dict | None = None  # the engine's speculation settings and acceptance (keyed /health)
        self.ignore_eos = True             # the server takes vLLM's ignore_eos extension (known lengths)
        self.refs = References(self)
        self.shared: dict[str, Any] = {}   # figures one case leaves for another (e.g. stream gaps)
        self.fault_tokens = 200            # the fault scenarios' in-flight request (faults.size_fault_request)

    # ----- discovery -------------------------------------------------------------------------
    def discover(self) -> list[str]:
        """Learn the model, the context limit and what the service is; returns notes for the report."""
        notes: list[str] = []
        a = self.client.get("/v1/models", timeout_s=30)
        if not a.ok:
            if a.status is None:  # no answer at all: the transport's error, said once
                raise ConnectionError(f"{self.target.endpoint}/v1/models could not be reached: {a.error}")
            raise ConnectionError(f"{self.target.endpoint}/v1/models answered {a.status}: {a.error_message()}")
        data = a.body.get("data") or []
        if not self.model:
            if not data:
                raise ConnectionError(f"{self.target.endpoint}/v1/models lists no model")
            self.model = data[0]["id"]
        card = next((m for m in data if m.get("id") == self.model), data[0] if data else {})
        if self.max_context is None and isinstance(card.get("max_model_len"), int):
            self.max_context = card["max_model_len"]
        self.server = a.headers.get("server")
        if card.get("owned_by") == "v100plan":
            self.is_engine = True
            self.server = "v100plan engine"
        if not self.is_engine:
            probe = self.client.post("/v1/completions", {"model": self.model, "prompt": "Hi", "max_tokens": 1,
                                                         "ignore_eos": True}, timeout_s=120)
            if probe.status is not None and 400 <= probe.status < 500:
                self.ignore_eos = False
                notes.append(f"the server refuses vLLM's ignore_eos extension ({probe.status}): requests go "
                             "without it, so an answer may end early at an end-of-sequence token and length "
                             "checks are judged against the server's own first answer")
        if self.is_engine:  # what code served: the keyed /health names each rank's decode mode, kernels, exchange
            h = self.client.get("/health", timeout_s=10)
            dec = h.body.get("decode") if h.ok and isinstance(h.body, dict) else None
            limits = h.body.get("limits") if h.ok and isinstance(h.body, dict) else None
            if isinstance(limits, dict):
                self.limits = {k: v for k, v in limits.items() if isinstance(v, (int, float)) or v is None}
            self.note_speculation(h)
            if isinstance(dec, dict):
                self.decode = {r: {k: d.get(k) for k in DECODE_FIELDS if k in d}
                               for r, d in dec.items() if isinstance(d, dict)} or None
        t = self.client.get("/control/targets", timeout_s=10)
        self.fault_control = t.status == 200 and isinstance(t.body, dict) and "actions" in t.body
        if self.is_engine and not self.fault_control:
            from v100plan.accept.faults import FAULT_CONTROL_HOW

            notes.append(f"the engine's fault control does not answer ({FAULT_CONTROL_HOW}, and reach it from "
                         "loopback): fault scenarios are waived")
        if self.target.model_dir is not None and self.refs.half_precision:
            notes.append(f"served in {self.refs.half_precision}: answers are checked against the service's own "
                         "quiet answer, not a TP1 run (TP2's split sums round differently from one card's), so an "
                         "answer that changes under load counts as differs, not wrong")
        return notes

    # ----- requests ---------------------------------------------------------------------------
    def payload(self, prompt: str, max_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
                **extra) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                **({"ignore_eos": True} if self.ignore_eos else {}), **extra}
        if seed is not None:
            body["seed"] = seed
        return body

    def matches(self, ref: Reference, text: str, token_ids: list[int] | None) -> bool:
        if ref.token_ids is not None and token_ids is not None:
            return token_ids == ref.token_ids
        return text == ref.text

    def is_prefix(self, ref: Reference, text: str) -> bool:
        return ref.text.startswith(text)

    # ----- the bundled engine's state ---------------------------------------------------------
    def note_speculation(self, h: Answer | None = None) -> None:
        """Keep the keyed /health's "speculation" (settings, drafted and accepted tokens since the service started,
        their ratio); the report shows the last one read. Nothing changes when /health does not say."""
        h = h or self.health()
        spec = h.body.get("speculation") if h.ok and isinstance(h.body, dict) else None
        if isinstance(spec, dict):
            self.speculation = spec

    def health(self, timeout_s: float = 5.0) -> Answer:
        return self.client.get("/health", timeout_s=timeout_s)

    def generation(self) -> int | None:
        a = self.health()
        return a.body.get("generation") if a.ok else None

    def wait_healthy(self, timeout_s: float, newer_than: int | None = None, step_s: float = 0.05) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            a = self.health(timeout_s=2.0)
            if a.status == 200 and isinstance(a.body, dict):
                gen = a.body.get("generation")
                if newer_than is None or (gen is not None and gen > newer_than):
                    return a.body
            time.sleep(step_s)
        return None

    def inject(self, action: str, rank: int | None = None, **extra) -> Answer:
        return self.client.post("/control/inject", {"action": action, "rank": rank, **extra}, timeout_s=10)

    def rank_logs(self) -> dict[int, str]:
        return self.target.read_rank_logs() if self.target.read_rank_logs else {}

    def close(self) -> None:
        self.client.close()
