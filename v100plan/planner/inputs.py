"""The planner's inputs as frozen dataclasses, read from validated profile documents.

Units are in the field names: GB = 1e9 bytes, GiB = 2**30 bytes, GB/s = 1e9 bytes/s.
A value the profile does not have is None and the matching ``*_why`` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GIB_IN_GB = 2**30 / 1e9  # 1 GiB = 1.0737 GB


@dataclass(frozen=True)
class Sourced:
    """A number and where it comes from; value None means "not known" and source says why."""

    value: float | None
    source: str


@dataclass(frozen=True)
class Card:
    id: str
    name: str
    compute_capability: str
    native_bf16: bool
    memory_gib: float
    read_bw: Sourced                 # GB/s the planner divides by: measured where known, else nominal
    tensor_tflops: Sourced           # dense fp16 (Volta) or bf16 tensor peak, the prefill ceiling
    price_per_card: tuple[float, str] | None  # (amount, currency)

    @property
    def memory_gb(self) -> float:
        return self.memory_gib * GIB_IN_GB

    @property
    def dtype(self) -> str:
        """fp16 on cards without native bf16 (Volta), bf16 elsewhere (STYLE.md habit 6: a profile fact)."""
        return "bfloat16" if self.native_bf16 else "float16"


@dataclass(frozen=True)
class Pair:
    """What two cards of this kind in one box do together (from the catalogue or a probe report)."""

    interconnect: str                # "pcie" | "nvlink"
    p2p: str                         # "working" | "broken" | "unknown"
    nccl_supported: bool | None      # None: not known (catalogue); False: installed NCCL lacks this arch
    nccl_why: str | None
    sm_clock_ratio: Sourced          # median SM clock under pair load / max; None: not known (taken as 1.0)
    allreduce_us: dict[str, dict[str, float]]  # path -> {"40k": us, ...} measured on this box
    allreduce_source: str
    p2p_bulk_gbps: float | None      # measured between the cards
    link_bw_nominal_gbps: float | None = None  # datasheet, one direction (NVLink or the PCIe slot)

    def bulk_gbps(self) -> float | None:
        """Bandwidth a large peer-to-peer allreduce message moves at: measured, else the link's datasheet
        figure (optimistic), and only when peer-to-peer works; None otherwise."""
        if self.p2p != "working":
            return None
        return self.p2p_bulk_gbps or self.link_bw_nominal_gbps


@dataclass(frozen=True)
class Hardware:
    card: Card
    pair: Pair
    gpus: int
    origin: str                      # catalogue id or probe report path
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Model:
    id: str
    name: str
    family: str
    format: str
    native_context: int
    attention_layers: int
    kv_heads: int
    q_heads: int
    head_dim: int
    kv_bytes_per_element: float
    kv_overhead_bytes_per_token: float
    state_bytes_per_sequence: float
    weights_total_gb: float
    weights_split_gb: float
    weights_replicated_gb: float
    decode_read_gb: float
    matrix_flops_per_token: float
    allreduces_per_round: int
    allreduce_bytes_per_token: float
    max_draft_tokens: int
    acceptance: dict[str, float] = field(default_factory=dict)
    moe_experts: int = 0              # experts per MoE layer (0: dense)
    moe_active_experts: int = 0       # experts each token is routed to
    moe_expert_gb: float = 0.0        # all experts' weights (part of the split weights, not of decode_read_gb)

    @property
    def kv_shape_bytes_per_token(self) -> float:
        """attention layers x KV heads x head_dim x 2 (K and V) x bytes per element (GDN layers hold no KV)."""
        return self.attention_layers * self.kv_heads * self.head_dim * 2 * self.kv_bytes_per_element

    @property
    def kv_bytes_per_token(self) -> float:
        """The shape plus the model profile's named, sourced overhead per token."""
        return self.kv_shape_bytes_per_token + self.kv_overhead_bytes_per_token


@dataclass(frozen=True)
class Engine:
    id: str
    name: str
    weight_bw_fraction: Sourced
    weight_bw_fraction_by_format: dict[str, Sourced]
    kv_bw_fraction: Sourced
    round_overhead_ms: Sourced
    prefill_compute_fraction: Sourced
    prefill_attention_fraction: Sourced
    runtime_reserve_gb: Sourced
    prefill_chunk_tokens: int
    draft_tokens: int
    default_acceptance: float
    allreduce_us: dict[str, dict[str, float]]
    allreduce_paths: tuple[str, ...]
    # Half-width kernels under TP2 (each card runs every split matrix and its share of the KV heads at half
    # width): achieved fractions of the read bandwidth per card. None: the one-card fractions stand in.
    tp2_weight_bw_fraction: Sourced = Sourced(None, "not in the engine profile")
    tp2_kv_bw_fraction: Sourced = Sourced(None, "not in the engine profile")

    def weight_fraction_for(self, fmt: str) -> tuple[Sourced, str | None]:
        """The weight-read fraction for a weight format, and a note when the engine's default stands in."""
        if fmt in self.weight_bw_fraction_by_format:
            return self.weight_bw_fraction_by_format[fmt], None
        note = None
        if self.weight_bw_fraction_by_format:
            note = (f"engine {self.id} is not calibrated for {fmt} weights; its default weight_bw_fraction "
                    f"({_fmt(self.weight_bw_fraction.value)}) stands in")
        return self.weight_bw_fraction, note

    def decode_fractions(self, fmt: str, tp: int) -> tuple[Sourced, Sourced]:
        """(weight, KV) read fractions for one card of a ``tp``-way split: under TP2 the engine's tp2_* figures
        where the profile has them, else (and at TP1) the one-card figures."""
        fw, _ = self.weight_fraction_for(fmt)
        fk = self.kv_bw_fraction
        if tp == 2:
            if self.tp2_weight_bw_fraction.value is not None:
                fw = self.tp2_weight_bw_fraction
            if self.tp2_kv_bw_fraction.value is not None:
                fk = self.tp2_kv_bw_fraction
        return fw, fk

    def tp2_fallback_note(self) -> str | None:
        """What the plan says when TP2 reads at the one-card fractions (None when the profile has both TP2 figures)."""
        absent = [n for n in ("tp2_weight_bw_fraction", "tp2_kv_bw_fraction") if getattr(self, n).value is None]
        if not absent:
            return None
        return (f"engine {self.id} has no {' or '.join(absent)}: tp2 reads at the one-card fractions, as if half-width "
                "kernels were as efficient as full-width ones (the profile's calibration says whether a TP2 figure checked it)")

    def missing_for_decode(self, fmt: str) -> list[str]:
        """Efficiencies a decode prediction needs that this profile does not have (not yet measured)."""
        fw, _ = self.weight_fraction_for(fmt)
        found = [] if fw.value is not None else ["weight_bw_fraction"]
        return found + [n for n in ("kv_bw_fraction", "round_overhead_ms") if getattr(self, n).value is None]

    def missing_for_prefill(self) -> list[str]:
        return [n for n in ("prefill_compute_fraction", "prefill_attention_fraction") if getattr(self, n).value is None]


@dataclass(frozen=True)
class Target:
    context_tokens: int
    gpus: int
    acceptance: float | None = None  # None: the engine profile's default
    concurrency: int = 1
    objective: str = "latency"       # "latency" | "throughput"


def _latency_tables(raw: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    """path -> {size: us}, keeping only measured sizes (a path may carry just 'unavailable': reason)."""
    tables = {}
    for path, table in (raw or {}).items():
        if isinstance(table, dict):
            numbers = {k: float(v) for k, v in table.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if numbers:
                tables[path] = numbers
    return tables


def _fmt(v: float | None) -> str:
    return "none" if v is None else f"{v:g}"


def _sourced(doc: dict[str, Any] | None, fallback_source: str = "not given") -> Sourced:
    if doc is None:
        return Sourced(None, fallback_source)
    return Sourced(doc.get("value"), doc.get("source", fallback_source))


def card_from_doc(doc: dict[str, Any]) -> Card:
    sources, unavailable = doc.get("sources", {}), doc.get("unavailable", {})
    if doc.get("mem_bw_measured_gbps") is not None:
        bw = Sourced(doc["mem_bw_measured_gbps"], "measured: " + sources.get("mem_bw_measured_gbps", "profile"))
    else:
        bw = Sourced(doc["mem_bw_nominal_gbps"], "nominal (" + unavailable.get("mem_bw_measured_gbps", "not measured")
                     + "): " + sources.get("mem_bw_nominal_gbps", "profile"))
    key = "bf16_tensor_tflops" if doc.get("native_bf16") else "fp16_tensor_tflops"
    tensor = Sourced(doc.get(key), sources.get(key) or unavailable.get(key, "not in the hardware profile"))
    price = doc.get("price_per_card")
    return Card(
        id=doc["id"], name=doc["name"], compute_capability=doc["compute_capability"],
        native_bf16=bool(doc.get("native_bf16")), memory_gib=float(doc["memory_gib"]), read_bw=bw, tensor_tflops=tensor,
        price_per_card=(float(price["amount"]), price["currency"]) if price else None,
    )


def pair_from_doc(doc: dict[str, Any]) -> Pair:
    p = doc.get("pair") or {}
    srcs, una = p.get("sources", {}), p.get("unavailable", {})
    ratio = p.get("sm_clock_ratio_under_pair_load")
    return Pair(
        interconnect=p.get("interconnect", "pcie"), p2p=p.get("p2p", "unknown"),
        nccl_supported=None, nccl_why=None,
        sm_clock_ratio=Sourced(ratio, srcs.get("sm_clock_ratio_under_pair_load")
                               or una.get("sm_clock_ratio_under_pair_load", "not known")),
        allreduce_us=_latency_tables(p.get("allreduce_us")),
        allreduce_source=srcs.get("allreduce_us", "no allreduce figures for this box"),
        p2p_bulk_gbps=p.get("p2p_bulk_gbps"), link_bw_nominal_gbps=p.get("link_bw_nominal_gbps"),
    )


def hardware_from_doc(doc: dict[str, Any], gpus: int) -> Hardware:
    return Hardware(card=card_from_doc(doc), pair=pair_from_doc(doc), gpus=gpus, origin=doc["id"])


def model_from_doc(doc: dict[str, Any]) -> Model:
    w, kv, tp, att, layers = doc["weights"], doc["kv_cache"], doc["tp"], doc["attention"], doc["layers"]
    draft = doc.get("draft") or {}
    moe = doc.get("moe") or {}
    acc = {k: v for k, v in (doc.get("acceptance") or {}).items() if k != "sources"}
    return Model(
        id=doc["id"], name=doc["name"], family=doc.get("family", doc["id"]), format=doc.get("format", "unknown"),
        native_context=int(doc["native_context"]), attention_layers=int(layers["full_attention"]),
        kv_heads=int(att["kv_heads"]), q_heads=int(att["q_heads"]), head_dim=int(att["head_dim"]),
        kv_bytes_per_element=float(kv["bytes_per_element"]),
        kv_overhead_bytes_per_token=float(kv.get("overhead_bytes_per_token", 0)),
        state_bytes_per_sequence=float(doc.get("state_bytes_per_sequence") or 0),
        weights_total_gb=float(w["total_gb"]), weights_split_gb=float(w["split_gb"]),
        weights_replicated_gb=float(w["replicated_gb"]), decode_read_gb=float(w["decode_read_gb"]),
        matrix_flops_per_token=float(doc["matrix_flops_per_token"]),
        allreduces_per_round=int(tp["allreduces_per_round"]), allreduce_bytes_per_token=float(tp["allreduce_bytes_per_token"]),
        max_draft_tokens=int(draft.get("max_draft_tokens", 0)), acceptance=acc,
        moe_experts=int(moe.get("experts", 0)), moe_active_experts=int(moe.get("active_experts", 0)),
        moe_expert_gb=float(moe.get("expert_gb", 0.0)),
    )


def _attention_fraction(eff: dict[str, Any], missing: str) -> Sourced:
    """The prefill attention kernel's own fraction, else the matrix one stands in (said in the source)."""
    own = _sourced(eff.get("prefill_attention_fraction"), missing)
    if own.value is not None:
        return own
    matrix = _sourced(eff.get("prefill_compute_fraction"), missing)
    if matrix.value is None:
        return own
    return Sourced(matrix.value, "prefill_compute_fraction stands in (no attention-kernel figure): " + matrix.source)


def engine_from_doc(doc: dict[str, Any]) -> Engine:
    eff = doc.get("efficiency", {})
    spec = doc.get("speculative") or {}
    missing = f"not in engine profile {doc['id']}"
    return Engine(
        id=doc["id"], name=doc["name"],
        weight_bw_fraction=_sourced(eff.get("weight_bw_fraction"), missing),
        weight_bw_fraction_by_format={k: _sourced(v) for k, v in (eff.get("weight_bw_fraction_by_format") or {}).items()},
        kv_bw_fraction=_sourced(eff.get("kv_bw_fraction"), missing),
        round_overhead_ms=_sourced(eff.get("round_overhead_ms"), missing),
        prefill_compute_fraction=_sourced(eff.get("prefill_compute_fraction"), missing),
        prefill_attention_fraction=_attention_fraction(eff, missing),
        runtime_reserve_gb=_sourced(eff.get("runtime_reserve_gb"), missing),
        prefill_chunk_tokens=int(doc.get("prefill_chunk_tokens", 2048)),
        draft_tokens=int(spec.get("draft_tokens", 0)),
        default_acceptance=float(spec.get("default_acceptance", 0.0)),
        allreduce_us=_latency_tables(doc.get("allreduce_us")),
        allreduce_paths=tuple(doc.get("allreduce_paths", ("nccl", "host_mailbox", "device_mailbox"))),
        tp2_weight_bw_fraction=_sourced(eff.get("tp2_weight_bw_fraction"), missing),
        tp2_kv_bw_fraction=_sourced(eff.get("tp2_kv_bw_fraction"), missing),
    )
