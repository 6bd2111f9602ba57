"""Whether a host's cards can hold the new release beside the one serving: the choice of ``--switch auto``.

The facts are measured on the host now, through the deploy's own remote runner:

    nvidia-smi --query-gpu=index,memory.used,memory.total,memory.free --format=csv,noheader,nounits

(MiB per card). A host without nvidia-smi is a CPU host, which keeps blue/green (the ranks share the
host's memory). On a host that lists cards, each card must hold the new release's rank beside what is in
use there (the serving release included): need per rank = its weights (the shard manifest's bytes for
that rank, else the planner's tp2 layout of config.json) + its share of the K/V at the release's context
(the planner's ``kv_gb`` with ``kv_share_tp2``; the model's native context when no --max-context) x the
release's --max-concurrency + MARGIN_BYTES. A GPU release with no --max-concurrency takes as many sequence slots as its
card holds (the engine's default from memory), so it needs the whole card: it never starts beside another. The bundled engine puts rank r on cuda:r; with one card both ranks go on it. Every card
listed must hold it (CUDA's and nvidia-smi's orders may differ, so no card is assumed idle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from v100plan.errors import BadInput
from v100plan.remote import release as rel
from v100plan.remote.connect import Remote

QUERY = ["nvidia-smi", "--query-gpu=index,memory.used,memory.total,memory.free", "--format=csv,noheader,nounits"]
MIB = 1 << 20
# What a rank holds on its card besides weights and K/V: the CUDA context (about 0.5 GiB with torch), cuBLAS
# and Triton workspaces, the CUDA graph pools and the allocator's cached blocks from the prefill's activations.
# Stated, not measured per model (docs/deploy.md, "Blue/green on GPU hosts"): too much only costs an outage.
MARGIN_BYTES = 4 << 30
TP = 2


@dataclass(frozen=True)
class Card:
    index: int
    used_bytes: int
    total_bytes: int
    free_bytes: int


def parse_cards(text: str) -> list[Card]:
    """nvidia-smi's csv (noheader, nounits: MiB) as cards; a line that is not four integers is an error."""
    cards = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            raise ValueError(f"unexpected nvidia-smi line {line!r}")
        i, used, total, free = map(int, parts)
        cards.append(Card(i, used * MIB, total * MIB, free * MIB))
    return cards


def host_cards(remote: Remote) -> tuple[list[Card] | None, str]:
    """The host's cards now, and how that was found; None: no nvidia-smi there (a CPU host), or its output
    could not be read (the reason says which)."""
    r = remote.run(QUERY, check=False, timeout_s=60, what="nvidia-smi --query-gpu=memory")
    if r.exit_code == 127:
        return None, "no nvidia-smi on the host: a CPU host"
    try:
        cards = parse_cards(r.stdout) if r.exit_code == 0 else []
    except ValueError as e:
        return None, f"nvidia-smi's memory query could not be read ({e})"
    if not cards:
        tail = (r.stderr.strip() or r.stdout.strip())[-200:]
        return None, f"nvidia-smi lists no card (exit {r.exit_code}: {tail or 'no output'})"
    return cards, f"`{' '.join(QUERY)}` on the host"


def rank_need_bytes(config: dict[str, Any], settings: rel.EngineSettings,
                    bytes_per_rank: list[int] | None) -> list[int]:
    """Bytes each rank of a release holds on its card (the module's formula), from the planner's code;
    ``config``: the model's config.json, ``bytes_per_rank``: its shard manifest's (None: from the config)."""
    from v100plan.planner.from_config import model_doc
    from v100plan.planner.inputs import model_from_doc
    from v100plan.planner.memory import kv_gb
    from v100plan.planner.strategies import layout

    model = model_from_doc(model_doc(config, "config.json"))
    lay = layout("tp2", model, TP)
    context = settings.max_context or model.native_context
    slots = settings.max_concurrency or 1  # None on a GPU: the whole card (choose), on CPU one slot
    kv = kv_gb(model, context, lay.kv_share, slots) * 1e9 * (2 if settings.dtype == "float32" else 1)  # fp16/bf16 K/V
    weights = bytes_per_rank or [int(lay.weights_gb_per_gpu * 1e9)] * TP
    return [int(w + kv) + MARGIN_BYTES for w in weights]


@dataclass(frozen=True)
class Switch:
    mode: str                          # blue-green | stop-start
    why: str
    gpus: list[dict[str, Any]]         # per card: index, need_bytes, free_bytes, used_bytes, total_bytes, fits

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "why": self.why, "gpus": self.gpus}


def _gib(b: int) -> str:
    return f"{b / (1 << 30):.2f} GiB"


def per_card(cards: list[Card], need: list[int]) -> list[dict[str, Any]]:
    """Each card's need (its rank's; both ranks' on a one-card host) against its free memory."""
    rows = []
    for c in cards:
        n = sum(need) if len(cards) == 1 else max(need)
        rows.append({"index": c.index, "need_bytes": n, "free_bytes": c.free_bytes, "used_bytes": c.used_bytes,
                     "total_bytes": c.total_bytes, "fits": c.free_bytes >= n})
    return rows


def numbers(gpus: list[dict[str, Any]]) -> str:
    return "; ".join(f"GPU {g['index']}: needs {_gib(g['need_bytes'])}, {_gib(g['free_bytes'])} free of "
                     f"{_gib(g['total_bytes'])}" for g in gpus)


def choose(requested: str, settings: rel.EngineSettings, cards: list[Card] | None, found: str,
           need: list[int] | None, serving: str | None, host: str) -> Switch:
    """The switch and why. ``cards`` None: today's rule (CPU: blue/green; ranks on GPUs unmeasured:
    stop-start). ``--switch blue-green`` where a card cannot hold the new rank beside what runs there is
    bad input (exit 2), refused before anything stops; ``--switch stop-start`` is always honoured."""
    if requested == "stop-start":
        return Switch("stop-start", "--switch stop-start", [])
    if cards is None or need is None:
        if requested == "blue-green":
            return Switch("blue-green", "--switch blue-green", [])
        if settings.device == "cpu":
            return Switch("blue-green", f"both ranks on CPU ({found}): the new release starts beside the old one", [])
        return Switch("stop-start", f"ranks on GPUs whose free memory was not measured ({found}): the old release "
                      "stops first (an outage until the new one passes /health; --switch blue-green when both fit)", [])
    if settings.device != "cpu" and settings.max_concurrency is None:
        # the engine's default concurrency fills each card with as many slots as fit beside its own weights
        gpus = [{"index": c.index, "need_bytes": c.total_bytes, "free_bytes": c.free_bytes, "used_bytes": c.used_bytes,
                 "total_bytes": c.total_bytes, "fits": False} for c in cards]
        why = ("the new release takes as many sequence slots as its cards hold (no --max-concurrency: the engine's "
               "default from memory), so it needs the whole card")
        if requested == "blue-green" and serving:
            raise BadInput(f"{host}: --switch blue-green: {why} and cannot start beside release {serving}; nothing was "
                           "stopped", hint="deploy with --max-concurrency N (N slots that fit beside the old release), "
                                           "or --switch stop-start (an outage until the new release passes /health)")
        return Switch("stop-start", f"{why}: the old release stops first, an outage until the new one passes /health "
                      "(--max-concurrency N sizes it for blue-green)", gpus)
    gpus = per_card(cards, need)
    if all(g["fits"] for g in gpus):
        return Switch("blue-green", f"every card holds the new release's rank beside what is in use there "
                      f"({numbers(gpus)}; need = weights + K/V + {_gib(MARGIN_BYTES)} margin)", gpus)
    short = [g for g in gpus if not g["fits"]]
    if requested == "blue-green" and serving:
        raise BadInput(f"{host}: --switch blue-green: the new release does not fit beside release {serving} "
                       f"({numbers(short)}; need = weights + K/V + {_gib(MARGIN_BYTES)} margin); nothing was stopped",
                       hint="run it again with --switch stop-start (an outage until the new release passes "
                            "/health); a deploy with a smaller --max-context needs less")
    return Switch("stop-start", f"the cards cannot hold the new release beside what is in use ({numbers(short)}; "
                  f"need = weights + K/V + {_gib(MARGIN_BYTES)} margin): the old release stops first, an outage "
                  "until the new one passes /health", gpus)


def decide(remote: Remote, requested: str, settings: rel.EngineSettings, config: dict[str, Any],
           bytes_per_rank: list[int] | None, serving: str | None) -> Switch:
    """Measure the host's cards (unless --switch stop-start) and choose (``choose``)."""
    if requested == "stop-start":
        return choose(requested, settings, None, "", None, serving, remote.label)
    cards, found = host_cards(remote)
    need = rank_need_bytes(config, settings, bytes_per_rank) if cards is not None else None
    return choose(requested, settings, cards, found, need, serving, remote.label)
