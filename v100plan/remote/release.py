"""What a release is: the manifest that pins it, and the engine settings it runs with.

The release id is the first 16 hex digits of the SHA-256 of the manifest: the bundle's
SHA-256, the venv's dependency set, the engine settings, how the model was split and every
uploaded model file's SHA-256 (shard.json and each rank's files).
Any change to any of them is a new release; nothing changed is the same id.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from v100plan.errors import BadInput


@dataclass(frozen=True)
class EngineSettings:
    device: str = "cpu"                 # cpu, or cuda (rank r on cuda:r)
    dtype: str | None = None            # None: the engine's default (float32 on CPU, float16 on CUDA)
    allreduce: str = "auto"             # auto lets the engine's start-up race decide
    max_context: int | None = None
    port: int = 8000                    # the service binds 127.0.0.1:port on the host
    fault_injection: bool = False       # /control/* for the acceptance suite (loopback only)
    chosen_by: str = "defaults"         # "plan FILE", "probe of HOST", "defaults"
    serve_extra: tuple[str, ...] = ()   # more `serve` flags (qualify's shortened watchdog limits)
    kv_cache_dtype: str = "auto"        # auto (the model's dtype) or int8
    draft_tokens: int = 0               # MTP drafts per round (--speculative mtp --draft-tokens K); 0: off
    max_concurrency: int | None = None  # requests decoded at once (serve --max-concurrency); None: the engine's
                                        # default (1 on CPU or with MTP; else what fits the cards)

    def __post_init__(self) -> None:
        object.__setattr__(self, "serve_extra", tuple(self.serve_extra))  # a manifest holds a JSON list

    def serve_flags(self, model_dir: str, api_key_file: str, log_file: str | None = None) -> list[str]:
        flags = ["--model", model_dir, "--host", "127.0.0.1", "--port", str(self.port),
                 "--api-key-file", api_key_file, "--device", self.device, "--allreduce", self.allreduce]
        if log_file:
            flags += ["--log-file", log_file]
        if self.dtype:
            flags += ["--dtype", self.dtype]
        if self.max_context:
            flags += ["--max-context", str(self.max_context)]
        if self.kv_cache_dtype != "auto":
            flags += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.draft_tokens:
            flags += ["--speculative", "mtp", "--draft-tokens", str(self.draft_tokens)]
        if self.max_concurrency is not None:
            flags += ["--max-concurrency", str(self.max_concurrency)]
        if self.fault_injection:
            flags.append("--enable-fault-injection")
        return flags + list(self.serve_extra)

    def launch(self) -> dict[str, Any]:
        """The launch settings as the acceptance suite reads them (tp, devices, dtype, allreduce, context)."""
        devices = ["cpu", "cpu"] if self.device == "cpu" else ["cuda:0", "cuda:1"]
        dtype = self.dtype or ("float32" if self.device == "cpu" else "float16")
        return {"tp": 2, "devices": devices, "dtype": dtype, "allreduce": self.allreduce,
                "max_context": self.max_context, "kv_cache_dtype": self.kv_cache_dtype,
                "draft_tokens": self.draft_tokens, "max_concurrency": self.max_concurrency}

    def pinned(self) -> dict[str, Any]:
        """The settings that change what runs (not how they were chosen)."""
        d = asdict(self)
        d.pop("chosen_by")
        if not self.serve_extra:  # absent unless given: releases made before the field keep their ids
            d.pop("serve_extra")
        else:
            d["serve_extra"] = list(self.serve_extra)
        for name, default in (("kv_cache_dtype", "auto"), ("draft_tokens", 0),  # the same: absent at their default
                              ("max_concurrency", None)):
            if d[name] == default:
                d.pop(name)
        return d


# The bundled engine's K/V cache types (serve --kv-cache-dtype): a plan's 16-bit K/V is the model's own dtype.
_PLAN_KV = {"int8": "int8", "bf16": "auto", "fp16": "auto", "auto": "auto", None: "auto"}


def plan_origin(plan: dict[str, Any], source: str, sha256: str) -> dict[str, Any]:
    """Where a deploy's settings came from: the plan file, its digest, and what it predicted for the strategy the
    bundled engine runs (status shows it; the acceptance report holds its predictions against what it measured)."""
    launch = plan.get("launch") or {}
    tp2 = next((s for s in plan.get("strategies", []) if s.get("name") == "tp2"), None) or {}
    inputs = plan.get("inputs") or {}
    return {"plan": source, "plan_sha256": sha256, "strategy": "tp2", "recommended": plan.get("recommended"),
            "hardware": inputs.get("hardware"), "gpus": inputs.get("gpus"), "model": inputs.get("model"),
            "context_tokens": inputs.get("context_tokens"), "workload": launch.get("workload"),
            "acceptance": launch.get("acceptance"), "decode_tok_s": tp2.get("decode_tok_s"),
            "max_context": tp2.get("max_context"), "concurrency": launch.get("concurrency")}


SLOT_PORT = "<SLOT_PORT>"   # the port of the slot the release starts in (the front serves --port)
SLOT_DIR = "<SLOT_DIR>"     # that slot's state directory on the host


def serve_command(settings: EngineSettings, release_dir: str, key_file: str) -> list[str]:
    """`python -m engine serve ...` as the host's supervisor runs it for a release, with placeholders for the
    slot (its port and state directory) the host picks at the switch."""
    flags = settings.serve_flags(f"{release_dir}/model", key_file, log_file=f"{SLOT_DIR}/service.log")
    flags[flags.index("--port") + 1] = SLOT_PORT
    return [f"{release_dir}/venv/bin/python", "-m", "engine", "serve", *flags]


def settings_from_plan(plan: dict[str, Any], source: str, port: int,
                       fault_injection: bool) -> tuple[EngineSettings, str]:
    """The plan's launch settings for the bundled (two-rank) engine, and a sentence saying what was taken.

    When the plan recommends another strategy (one card, replicas, a layer split), its tp2 strategy
    is used if that fits, and the sentence says so."""
    launch = plan.get("launch")
    if not launch:
        raise BadInput(f"{source}: the plan has no launch settings (nothing fits the cards)",
                       hint="plan again with a smaller context or model: `v100plan plan ...`")
    allreduce, note = launch["allreduce"], ""
    if launch["tp"] != 2 or allreduce == "none":
        tp2 = next((s for s in plan.get("strategies", []) if s.get("name") == "tp2" and s.get("fits")), None)
        if tp2 is None or tp2.get("allreduce_path") in (None, "none"):
            raise BadInput(f"{source}: the plan chose {launch['strategy']} and has no tp2 strategy that fits; "
                           "the bundled engine serves two tensor-parallel ranks only",
                           hint="serve the chosen strategy with another engine, or plan for a model that fits tp2")
        allreduce = tp2["allreduce_path"]
        note = (f" (the plan recommends {launch['strategy']}; the bundled engine runs two tensor-parallel ranks, "
                f"so its tp2 strategy: {tp2.get('decode_tok_s')} tok/s predicted)")
    kv = launch.get("kv_cache_dtype")
    if kv not in _PLAN_KV:
        raise BadInput(f"{source}: the plan's K/V cache is {kv}, which the bundled engine does not hold "
                       "(it holds the model's dtype or int8)",
                       hint="plan again with --kv-cache-dtype int8 (or none), or deploy with --kv-cache-dtype")
    draft = int(launch.get("draft_tokens") or 0) if launch.get("speculative") == "mtp" else 0
    # The plan's concurrency (plan --concurrency: the sequences it priced) is the served N; a plan made before the
    # launch settings said it leaves the engine's default.
    concurrency = launch.get("concurrency")
    settings = EngineSettings(device="cuda", dtype=launch["dtype"], allreduce=allreduce,
                              max_context=launch["max_context"], port=port, fault_injection=fault_injection,
                              chosen_by=f"plan {source}", kv_cache_dtype=_PLAN_KV[kv], draft_tokens=draft,
                              max_concurrency=int(concurrency) if isinstance(concurrency, int) else None)
    why = (f"settings from {source}: ranks on cuda:0 and cuda:1, {settings.dtype}, allreduce {allreduce}, "
           f"context limit {settings.max_context}, K/V {settings.kv_cache_dtype}, "
           + (f"MTP speculation with {draft} draft tokens" if draft else "no speculation") + ", "
           + concurrency_phrase(settings.max_concurrency, "the plan's concurrency") + note)
    return settings, why


def concurrency_phrase(n: int | None, whose: str) -> str:
    """How many requests the release decodes at once, in words."""
    if n is None:
        return "requests at once: the engine's default (1 on CPU or with MTP; else what fits the cards)"
    return (f"{n} requests at once" if n > 1 else "1 request at a time") + f" ({whose})"


def settings_sentence(engine: dict[str, Any], health: dict[str, Any]) -> str:
    """What the service runs with: the release's settings, and the context /health says the ranks chose."""
    s = EngineSettings(**engine)
    ctx = health.get("context") or {}
    context = (f"context {ctx['max_context']} ({ctx.get('bound')})" if ctx.get("max_context") else
               f"context {s.max_context}" if s.max_context else "context: the engine's default")
    said = health.get("concurrency") if isinstance(health.get("concurrency"), dict) else {}
    n = said.get("max_concurrency") if isinstance(said.get("max_concurrency"), int) else s.max_concurrency
    slots = (f"{n} at once" + (f" ({said['bound']})" if said.get("bound") else "") if n is not None
             else "requests at once: the engine's default")
    return (f"{s.device}, {s.dtype or 'dtype by card'}, allreduce {health.get('allreduce') or s.allreduce}, {context}, "
            f"{slots}, K/V {s.kv_cache_dtype}, "
            + (f"MTP {s.draft_tokens} draft tokens" if s.draft_tokens else "no speculation"))


def origin_sentence(origin: dict[str, Any] | None) -> str:
    """Where a release's settings came from, in a line."""
    if not origin:
        return "not recorded (a release made before v100plan kept it)"
    given = origin.get("given") or {}
    flags = f"; flags: {', '.join(f'{k} {v}' for k, v in given.items())}" if given else ""
    if origin.get("plan"):
        pred = origin.get("decode_tok_s")
        return (f"plan {origin['plan']} (sha256 {origin['plan_sha256'][:12]}, {origin.get('hardware')} x "
                f"{origin.get('gpus')}, {origin.get('model')}" + (f", {pred} tok/s predicted" if pred else "")
                + f"){flags}")
    return f"{origin.get('chosen_by', 'defaults')}{flags}"


def overrides_from_flags(max_context: int | None, dtype: str | None, kv: str | None, speculative: str | None,
               draft: int | None, allreduce: str | None, concurrency: str | None = None) -> dict:
    """The engine settings given by flag (None: take the plan's or the probe's), each checked here. ``concurrency``:
    --max-concurrency, a number of requests decoded at once or `memory` (the engine's default)."""
    from engine.allreduce.paths import ALLREDUCE_CHOICES  # stdlib-only
    from engine.core.speculative import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS  # stdlib-only

    if max_context is not None and max_context < 2:
        raise BadInput(f"--max-context {max_context}: a request needs at least one prompt and one generated "
                       "token", hint="e.g. --max-context 4096 (default: the plan's, else the model's)")
    for flag, value, choices in (("--dtype", dtype, ("float16", "bfloat16", "float32")),
                                 ("--kv-cache-dtype", kv, ("auto", "int8")), ("--speculative", speculative, ("mtp", "off")),
                                 ("--allreduce", allreduce, ALLREDUCE_CHOICES)):
        if value is not None and value not in choices:
            raise BadInput(f"{flag} {value!r}: use one of {', '.join(choices)}", hint=f"e.g. {flag} {choices[0]}")
    if draft is not None and not 1 <= draft <= MAX_DRAFT_TOKENS:
        raise BadInput(f"--draft-tokens {draft}: give 1 to {MAX_DRAFT_TOKENS}", hint="or --speculative off")
    if speculative == "off" and draft is not None:
        raise BadInput("--speculative off and --draft-tokens together", hint="give one of them")
    # --speculative mtp alone: the plan's draft tokens where it speculates, else the engine's default
    tokens = 0 if speculative == "off" else draft if draft is not None else -DEFAULT_DRAFT_TOKENS \
        if speculative == "mtp" else None
    return {"max_context": max_context, "dtype": dtype, "kv_cache_dtype": kv, "draft_tokens": tokens,
            "allreduce": allreduce, "max_concurrency": _concurrency_flag(concurrency)}


def _concurrency_flag(text: str | None) -> int | str | None:
    """--max-concurrency N (1-64) or memory (kept as the word: with_overrides makes it the engine's default)."""
    from engine.service.concurrency_default import MAX_CONCURRENCY  # stdlib-only

    if text is None or text == "memory":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_CONCURRENCY or str(n) != text.strip():
        raise BadInput(f"--max-concurrency {text!r}: give 1 to {MAX_CONCURRENCY}, or memory (the engine's default: "
                       "what fits the cards)", hint="e.g. --max-concurrency 8")
    return n


def with_overrides(settings: EngineSettings, overrides: dict[str, Any]) -> tuple[EngineSettings, str]:
    """``settings`` with the flags the user gave (field -> value; None: not given), and a sentence naming them.
    draft_tokens -K: speculation on, with the settings' own draft tokens where they have some, else K."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return settings, ""
    if given.get("draft_tokens", 0) < 0:
        given["draft_tokens"] = settings.draft_tokens or -given["draft_tokens"]
    flag = {"max_context": "--max-context", "dtype": "--dtype", "kv_cache_dtype": "--kv-cache-dtype",
            "draft_tokens": "--draft-tokens", "allreduce": "--allreduce", "max_concurrency": "--max-concurrency"}
    said = ", ".join("--speculative off" if k == "draft_tokens" and v == 0 else f"{flag[k]} {v}"
                     for k, v in given.items())
    if given.get("max_concurrency") == "memory":
        given["max_concurrency"] = None
    return replace(settings, **given), f"; given: {said}"


def settings_from_probe(report: dict[str, Any], host: str, port: int, fault_injection: bool,
                        max_context: int | None) -> tuple[EngineSettings, str]:
    """Settings for the host as probed, and one sentence saying what was chosen and why."""
    cards = report.get("cards") or []
    if len(cards) < 2:
        why = (f"{host} has {len(cards)} NVIDIA card(s) the probe could see: the two ranks run on CPU (float32), "
               "allreduce over gloo")
        return EngineSettings(device="cpu", allreduce="gloo", max_context=max_context, port=port,
                              fault_injection=fault_injection, chosen_by=f"probe of {host}"), why
    ccs = sorted({c.get("compute_capability") or "?" for c in cards[:2]})
    old = any(cc != "?" and float(cc) < 8.0 for cc in ccs)
    dtype = "float16" if old else "bfloat16"
    why = (f"{host} has {len(cards)} cards (compute capability {', '.join(ccs)}): ranks on cuda:0 and cuda:1, "
           f"{dtype}" + (" (no native bfloat16 below 8.0)" if old else "") +
           ", allreduce path chosen by the engine's start-up race")
    # one request at a time, as a plan with the planner's default concurrency gives (--max-concurrency overrides)
    return EngineSettings(device="cuda", dtype=dtype, allreduce="auto", max_context=max_context, port=port,
                          fault_injection=fault_injection, chosen_by=f"probe of {host}", max_concurrency=1), why


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_speculation(settings: EngineSettings, model_dir: Path) -> None:
    """MTP speculation asked for a model without an MTP layer is bad input here, not a release that fails to
    start."""
    if not settings.draft_tokens:
        return
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # check_json_files says what is wrong with it
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    if not (text.get("mtp_num_hidden_layers") or cfg.get("mtp_num_hidden_layers")):
        raise BadInput(f"MTP speculation ({settings.draft_tokens} draft tokens, {settings.chosen_by}) but "
                       f"{model_dir}'s config.json declares no MTP layer (mtp_num_hidden_layers)",
                       hint="deploy with --speculative off, or a checkpoint that carries its MTP layer")


JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "special_tokens_map.json")


def check_json_files(d: Path) -> None:
    """The model's JSON files (config, tokenizer) parse: one that does not is bad input now (exit 2), not a
    release that dies on the host after the upload."""
    if not (d / "config.json").is_file():
        raise BadInput(f"--model {str(d)!r}: no config.json there (expected a Hugging Face model directory)",
                       hint="give the model's directory, or --demo-model for the small generated one")
    for name in JSON_FILES:
        try:
            json.loads((d / name).read_bytes())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            why = f"{e.msg}, line {e.lineno}" if isinstance(e, json.JSONDecodeError) else str(e)
            raise BadInput(f"--model {str(d)!r}: {name} is not JSON ({why}); the service could not load it",
                           hint=f"replace {d / name} with the model's own file") from None


def model_files(model_dir: str | Path) -> dict[str, dict[str, Any]]:
    """{relative path: {sha256, bytes}} of every file in the model directory (its JSON files checked)."""
    d = Path(model_dir)
    check_json_files(d)
    return hash_files(d)


def hash_files(d: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {sha256, bytes}} of every file under ``d`` (hidden ones aside)."""
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(d).parts):
            h = hashlib.sha256()
            with open(p, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            out[p.relative_to(d).as_posix()] = {"sha256": h.hexdigest(), "bytes": p.stat().st_size}
    return out


def model_digest(files: dict[str, dict[str, Any]]) -> str:
    doc = json.dumps({k: v["sha256"] for k, v in sorted(files.items())}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def manifest(bundle_sha256: str, venv_id: str, requirements: list[str], settings: EngineSettings,
             files: dict[str, dict[str, Any]], sharding: dict[str, Any] | None = None,
             origin: dict[str, Any] | None = None) -> dict[str, Any]:
    """``files``: what is uploaded (the shard directory's files when ``sharding`` says how the model was
    split: {"tp": 2, "source": the unsplit files' digest}), so a different split is a different release."""
    model = {"digest": model_digest(files), "files": {k: v["sha256"] for k, v in sorted(files.items())}}
    if sharding is not None:
        model["sharding"] = dict(sharding)
    doc = {"bundle_sha256": bundle_sha256, "venv_id": venv_id, "requirements": sorted(requirements),
           "engine": settings.pinned(), "model": model}
    if origin is not None:
        doc["origin"] = origin
    return doc


def release_id(man: dict[str, Any]) -> str:
    """The manifest's hash; its ``origin`` (which plan chose the settings) is kept for status, not hashed: the
    same settings from another plan file run the same release."""
    pinned = {k: v for k, v in man.items() if k != "origin"}
    return hashlib.sha256(json.dumps(pinned, sort_keys=True).encode()).hexdigest()[:16]


def deployment_name(text: str) -> str:
    if not text or not all(c.isalnum() or c in "-_." for c in text) or text.startswith("."):
        raise BadInput(f"--deployment {text!r}: use letters, digits, '-', '_' and '.'",
                       hint="e.g. --deployment demo")
    return text


def local_user() -> str:
    try:
        return os.getlogin()
    except OSError:
        pass
    try:
        import pwd

        return os.environ.get("USER") or pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid without a passwd entry (a container)
        return f"uid {os.getuid()}"
