"""The planner's inputs as frozen dataclasses, read from validated profile documents.

Units are in the field names: GB = 1e9 bytes, GiB = 2**30 bytes, GB/s = 1e9 bytes/s.
A value the profile does not have is None and the matching ``*_why`` says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine import memory_fit  # stdlib-only: the memory arithmetic the engine runs too

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
    architecture: str = ""           # card generation: volta, turing, ampere, ada, hopper (engine efficiencies key on it)
    sm_count: int = 0                # streaming multiprocessors (0: not known)
    sm_clock_mhz: float = 0.0        # maximum SM clock (0: not known)
    power_limit_w: float = 0.0       # the board's default power limit (0: not known)

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
    link_latency_us: float | None = None       # one small message between two cards of the box (datasheet or measured)

    def bulk_gbps(self) -> float | None:
        """Bandwidth a large peer-to-peer allreduce message moves at: measured, else the link's datasheet
        figure (optimistic), and only when peer-to-peer works; None otherwise."""
        if self.p2p != "working":
            return None
        return self.p2p_bulk_gbps or self.link_bw_nominal_gbps


@dataclass(frozen=True)
class Network:
    """Between nodes: the NIC's bandwidth and one small message's latency (Ethernet or InfiniBand)."""

    kind: str                        # "ethernet" | "infiniband"
    bw_gbps: float                   # GB/s one direction (1e9 bytes/s)
    latency_us: float
    source: str


@dataclass(frozen=True)
class Hardware:
    card: Card
    pair: Pair
    gpus: int
    origin: str                      # catalogue id or probe report path
    notes: tuple[str, ...] = ()
    nodes: int = 1                   # boxes of ``gpus`` cards each
    network: Network | None = None   # between boxes (None: not known)
    # GPU count -> path -> {size: us}: one allreduce across that many cards of one box (the profile's 'box'),
    # and where each count's figures come from. Empty: only the pair's figures are known.
    box_allreduce_us: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    box_allreduce_source: dict[int, str] = field(default_factory=dict)
    # path -> where that path's box figures come from, when not the count's own source (the profile's
    # 'box.path_sources'), and path -> {"low_us", "high_us", "used_us", "why"} where the source gives a range.
    box_path_source: dict[str, str] = field(default_factory=dict)
    box_ranges: dict[str, dict[str, Any]] = field(default_factory=dict)

    def box_source(self, gpus: int, path: str) -> str:
        """Where the box's ``gpus``-card figure on ``path`` comes from."""
        return self.box_path_source.get(path) or self.box_allreduce_source.get(gpus, "hardware profile")


def linear_state_bytes(layers: int, la: dict[str, Any]) -> float:
    """Gated DeltaNet state of one sequence over ``layers`` linear-attention layers, from a model profile's
    linear_attention block: engine.memory_fit.linear_state_bytes (the formula the engine's default context uses too),
    with the conv window the kernel less one. The 27B hybrid: 153,944,064 B."""
    return memory_fit.linear_state_bytes(layers, la["key_heads"], la["value_heads"], la["key_head_dim"],
                                         la["value_head_dim"], la["conv_kernel"] - 1,
                                         la.get("state_bytes_per_element", 4), la.get("conv_bytes_per_element", 2))


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
    layers_total: int = 0             # every layer (pipeline stages split them); 0: not known
    draft_kind: str = ""              # "mtp" | "model" | "" (none)
    draft_read_gb: float | None = None  # bytes one draft step reads; None: inside the engine's calibration (said in the plan)
    assumptions: tuple[str, ...] = ()
    kv_dtype: str = ""
    head_gb: float = 0.0              # the output head as read per token (part of weights_split_gb); 0: not known
    draft_layers: int = 0             # a separate draft model's layers (its per-layer overhead); 0: not known
    kv_latent_dim: int = 0            # MLA: values cached per token and layer (K and V from one latent); 0: not MLA
    window_tokens: int = 0            # sliding-window layers attend to (and cache) this many positions; 0: none
    window_layers: int = 0            # how many of the attention layers are sliding-window layers
    # a vision tower: its matrix FLOPs and image tokens for one priced image (ModelProfile "vision"); None: text only
    vision: dict[str, Any] | None = None

    @property
    def layers(self) -> int:
        """Every layer a round runs (a per-layer overhead counts them): the profile's total, else its attention layers."""
        return self.layers_total or self.attention_layers

    @property
    def kv_shape_bytes_per_token(self) -> float:
        """attention layers x KV heads x head_dim x 2 (K and V) x bytes per element (GDN layers hold no KV);
        MLA: attention layers x the latent's width x bytes per element (K and V are read from one latent)."""
        if self.kv_latent_dim:
            return self.attention_layers * self.kv_latent_dim * self.kv_bytes_per_element
        return memory_fit.kv_bytes_per_position(self.attention_layers, self.kv_heads, self.head_dim,
                                                self.kv_bytes_per_element)

    @property
    def kv_bytes_per_token(self) -> float:
        """The shape plus the model profile's named, sourced overhead per token (every layer caching every position)."""
        return self.kv_shape_bytes_per_token + self.kv_overhead_bytes_per_token

    def kv_bytes_at(self, context_tokens: float) -> float:
        """One sequence's K/V bytes at ``context_tokens``: full-attention layers hold every position, sliding-window
        layers at most ``window_tokens`` (Mistral 7B: a 4,096 window over 32K positions is an 8x smaller cache):

          per layer and token x (full layers x T + window layers x min(T, W)) + overhead x T"""
        if not self.window_tokens or not self.window_layers:
            return self.kv_bytes_per_token * context_tokens
        per_layer = self.kv_shape_bytes_per_token / self.attention_layers
        full = self.attention_layers - self.window_layers
        return (per_layer * (full * context_tokens + self.window_layers * min(context_tokens, self.window_tokens))
                + self.kv_overhead_bytes_per_token * context_tokens)


@dataclass(frozen=True)
class BatchedStepRow:
    """One measured context of the engine's batched decode step: the one-sequence step's ms and the batched step's
    ms for C sequences decoded together, all of one run."""
    context_tokens: int
    solo_ms: float
    step_ms: dict[int, float]

    def ratios(self) -> dict[int, float]:
        """C -> the batched step's time over the one-sequence step's (the step ratio)."""
        return {c: ms / self.solo_ms for c, ms in sorted(self.step_ms.items())}


@dataclass(frozen=True)
class BatchedStepFamily:
    name: str                         # "bf16", "int4": the weights the figures were measured with
    formats: tuple[str, ...]          # the weight formats they stand for
    rows: tuple[BatchedStepRow, ...]  # by context, smallest first


@dataclass(frozen=True)
class BatchedStep:
    """The profile's ``batched_step``: what the engine's step for C sequences costs against its one-sequence step."""
    source: str
    note: str
    families: tuple[BatchedStepFamily, ...]

    def family_for(self, fmt: str) -> BatchedStepFamily | None:
        return next((f for f in self.families if fmt in f.formats), None)


def _batched_step(entry: dict[str, Any] | None) -> BatchedStep | None:
    if not entry:
        return None
    families = tuple(
        BatchedStepFamily(name, tuple(fam["formats"]), tuple(sorted(
            (BatchedStepRow(int(r["context_tokens"]), float(r["solo_ms"]),
                            {int(c): float(ms) for c, ms in r["step_ms"].items()}) for r in fam["contexts"]),
            key=lambda r: r.context_tokens)))
        for name, fam in entry["families"].items())
    return BatchedStep(entry["source"], entry["note"], families)


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
    # generation -> {"weight_bw_fraction_by_format": {fmt: Sourced}, "weight_bw_fraction": Sourced,
    #                "kv_bw_fraction": Sourced, "round_overhead_ms": Sourced, "round_overhead_per_layer_ms": Sourced}
    by_generation: dict[str, dict[str, Any]] = field(default_factory=dict)
    acceptance_definition: str = "per_token"   # "per_token": (1 - a^(k+1)) / (1 - a); "accepted_share": 1 + k x A
    acceptance_source: str = ""
    acceptance_by_workload: dict[str, float] = field(default_factory=dict)  # the field's share of drafts accepted
    kv_cache_dtype: str | None = None          # the engine's default KV-cache element type
    launch_kind: str = ""                      # "vllm" | "sglang" | "llamacpp" | "v100plan" | "" (no launch commands)
    max_tp: int = 2                            # largest tensor-parallel degree the engine runs
    multi_node: bool = False                   # pipeline/tensor parallel across boxes
    max_concurrency: int | None = None         # most sequences decoded together (None: the engine batches)
    max_concurrency_source: str = ""
    # The engine's measured batched decode step (concurrency > 1 priced as its one-sequence round x the step's
    # ratio, batch_step.py). None: C sequences' reads with the weights once, as the arithmetic says.
    batched_step: BatchedStep | None = None
    aliases: tuple[str, ...] = ()
    generic_generations: tuple[str, ...] = ()  # generations the generation-free figures were calibrated on
    # Under tensor parallel: "split" (vocab parallel, each rank reads 1/tp of the output head) or "replicated"
    # (whole on every rank); the source says where the profile read it.
    tp_output_head: str = "split"
    tp_output_head_source: str = "default: vocab parallel"
    # The path the engine's own allreduces run on ("nccl", or "torch_intra_node": PyTorch's one-shot/two-shot
    # intra-node kernels); its figures are looked up on the box first, NCCL's stand in (said) where it has none.
    allreduce_path: str = "nccl"
    allreduce_path_source: str = "default: NCCL"
    # Overhead per layer of the model, per round (each layer launches the same small kernels whatever its width,
    # so it is neither divided by tensor parallel nor by pipeline stages); added to round_overhead_ms. None: none.
    round_overhead_per_layer_ms: Sourced = Sourced(None, "not in the engine profile")
    # Another engine of the same kind whose figures stand in where this one has no calibration that gives speeds
    # (the profile's 'stand_in_engine'; the chain in calibration.py), and why it is a fair stand-in.
    stand_in_engine: Engine | None = None
    stand_in_engine_source: str = ""
    # The card the one-card fractions were calibrated on ({"generation", "sm_count", "sm_clock_mhz", "read_bw_gbps",
    # "source"}): on another card of that generation the part of a read beyond 100 % bandwidth scales with the
    # card's compute (decode.compute_scaled_fraction). Empty: fractions carry over unchanged.
    calibration_card: dict[str, Any] = field(default_factory=dict)
    # The engine's own kernels as arithmetic, for generations it has no recording on (kernel_model.py). Empty: none.
    kernel_model: dict[str, Any] = field(default_factory=dict)
    strategies: tuple[str, ...] = ()          # the strategies the engine runs (empty: every one)
    formats: tuple[str, ...] = ()             # the weight formats the engine loads (empty: any)
    bundled: bool = False                      # shipped with v100plan (`python -m engine serve`, `v100plan deploy`)
    where: str = ""                            # where an engine that is not bundled is got

    def generation_entry(self, generation: str) -> dict[str, Any] | None:
        return self.by_generation.get(generation)

    def calibrated_generations(self) -> list[str]:
        return sorted(set(self.by_generation) | set(self.generic_generations))

    def fractions(self, fmt: str, fmt_family: str, generation: str, tp: int) -> tuple[Sourced, Sourced, Sourced, list[str]]:
        """(weight fraction, KV fraction, round overhead, notes) for a weight format on a card generation.

        Order: the generation's figure for this format, then for its family (gguf/int/float), then the
        generation's default; a generation the engine has no calibration for falls back to the engine's
        generation-free figures, and the notes say so."""
        notes: list[str] = []
        g = self.by_generation.get(generation)
        if g is not None:
            by_fmt = g.get("weight_bw_fraction_by_format", {})
            if fmt in by_fmt:
                fw = by_fmt[fmt]
            elif fmt_family and f"family:{fmt_family}" in by_fmt:
                fw = by_fmt[f"family:{fmt_family}"]
                notes.append(f"engine {self.id} on {generation}: no {fmt} calibration; its {fmt_family}-family figure "
                             f"({_fmt(fw.value)}) stands in")
            else:
                fw = g.get("weight_bw_fraction", self.weight_bw_fraction)
                notes.append(f"engine {self.id} on {generation}: no {fmt} calibration; its {generation} default "
                             f"weight fraction ({_fmt(fw.value)}) stands in")
            fk = g.get("kv_bw_fraction", self.kv_bw_fraction)
            if fk.value is None:
                fk = self.kv_bw_fraction
            oh = g.get("round_overhead_ms", self.round_overhead_ms)
            if fk.value is not None and "kv_bw_fraction" not in g:
                notes.append(f"engine {self.id} on {generation}: KV fraction not calibrated; the engine default stands in")
        else:
            fw, note = self.weight_fraction_for(fmt)
            if note:
                notes.append(note)
            fk, oh = self.kv_bw_fraction, self.round_overhead_ms
            if self.by_generation:
                notes.append(f"engine {self.id} has no calibration for {generation or 'this'} cards (calibrated: "
                             f"{', '.join(self.calibrated_generations())}); "
                             + ("its generation-free figures stand in" if fw.value is not None else "no speeds, the ceiling only"))
        if tp == 2:
            if self.tp2_weight_bw_fraction.value is not None:
                fw = self.tp2_weight_bw_fraction
            if self.tp2_kv_bw_fraction.value is not None:
                fk = self.tp2_kv_bw_fraction
        return fw, fk, oh, notes

    def per_layer_overhead(self, generation: str) -> Sourced:
        """round_overhead_per_layer_ms for a card generation, resolved as round_overhead_ms is: the generation's
        figure, else the engine's generation-free one."""
        g = self.by_generation.get(generation)
        if g is not None:
            return g.get("round_overhead_per_layer_ms", self.round_overhead_per_layer_ms)
        return self.round_overhead_per_layer_ms

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

    def missing_for_decode(self, fmt: str, fmt_family: str = "", generation: str = "") -> list[str]:
        """Efficiencies a decode prediction needs that this profile does not have (not yet measured)."""
        fw, fk, oh, _ = self.fractions(fmt, fmt_family, generation, 1)
        return [n for n, v in (("weight_bw_fraction", fw), ("kv_bw_fraction", fk), ("round_overhead_ms", oh)) if v.value is None]

    def missing_for_prefill(self) -> list[str]:
        return [n for n in ("prefill_compute_fraction", "prefill_attention_fraction") if getattr(self, n).value is None]


@dataclass(frozen=True)
class Target:
    context_tokens: int
    gpus: int
    acceptance: float | None = None  # None: the model's figure for the workload, else the engine profile's default
    concurrency: int = 1
    objective: str = "latency"       # "latency" | "throughput"
    draft_tokens: int | None = None  # None: the engine's default (capped by the model's draft layer)
    workload: str = "prose"          # which of the model's acceptance figures speculation is planned with


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
        architecture=str(doc.get("architecture", "")).lower(),
        sm_count=int(doc.get("sm_count") or 0), sm_clock_mhz=float(doc.get("sm_clock_max_mhz") or 0.0),
        power_limit_w=float(doc.get("power_limit_w") or 0.0),
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
        link_latency_us=p.get("link_latency_us"),
    )


def network_from_doc(doc: dict[str, Any] | None) -> Network | None:
    """The hardware profile's optional 'network' object (between nodes)."""
    if not doc:
        return None
    srcs = doc.get("sources", {})
    return Network(kind=doc["kind"], bw_gbps=float(doc["bw_gbps"]), latency_us=float(doc["latency_us"]),
                   source=srcs.get("bw_gbps", "hardware profile"))


def box_from_doc(doc: dict[str, Any] | None) -> tuple[dict[int, dict[str, dict[str, float]]], dict[int, str]]:
    """The hardware profile's optional 'box' object: allreduce tables per GPU count and their sources."""
    if not doc:
        return {}, {}
    tables = {int(n): t for n, raw in (doc.get("allreduce_us") or {}).items() if (t := _latency_tables(raw))}
    srcs = doc.get("sources", {})
    return tables, {n: srcs.get(str(n), "hardware profile") for n in tables}


def hardware_from_doc(doc: dict[str, Any], gpus: int, nodes: int = 1) -> Hardware:
    box = doc.get("box") or {}
    box_us, box_src = box_from_doc(box)
    return Hardware(card=card_from_doc(doc), pair=pair_from_doc(doc), gpus=gpus, origin=doc["id"], nodes=nodes,
                    network=network_from_doc(doc.get("network")), box_allreduce_us=box_us, box_allreduce_source=box_src,
                    box_path_source=dict(box.get("path_sources") or {}), box_ranges=dict(box.get("ranges") or {}))


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
        state_bytes_per_sequence=(linear_state_bytes(int(layers["linear_attention"]), doc["linear_attention"])
                                  if doc.get("linear_attention") else float(doc.get("state_bytes_per_sequence") or 0)),
        weights_total_gb=float(w["total_gb"]), weights_split_gb=float(w["split_gb"]),
        weights_replicated_gb=float(w["replicated_gb"]), decode_read_gb=float(w["decode_read_gb"]),
        matrix_flops_per_token=float(doc["matrix_flops_per_token"]),
        allreduces_per_round=int(tp["allreduces_per_round"]), allreduce_bytes_per_token=float(tp["allreduce_bytes_per_token"]),
        max_draft_tokens=int(draft.get("max_draft_tokens", 0)), acceptance=acc,
        moe_experts=int(moe.get("experts", 0)), moe_active_experts=int(moe.get("active_experts", 0)),
        moe_expert_gb=float(moe.get("expert_gb", 0.0)),
        layers_total=int(layers.get("total", 0)), draft_kind=str(draft.get("kind", "")) if draft else "",
        draft_read_gb=draft.get("read_gb_per_step"), assumptions=tuple(doc.get("assumptions") or ()),
        kv_dtype=str(kv.get("dtype", "")), head_gb=float(w.get("head_gb") or 0.0),
        kv_latent_dim=int(att.get("kv_latent_dim") or 0),
        window_tokens=int(att.get("sliding_window") or 0), window_layers=int(att.get("sliding_layers") or 0),
        vision={k: v for k, v in doc["vision"].items() if k != "sources"} if doc.get("vision") else None,
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


def _stand_in_engine(doc: dict[str, Any], others: Mapping[str, dict[str, Any]],
                     seen: tuple[str, ...]) -> tuple[Engine | None, str]:
    """The engine the profile names as its stand-in (``stand_in_engine``), from the engine documents handed in
    (``others``: id -> document), read once (no cycles). None where none is named or it is a cycle."""
    entry = doc.get("stand_in_engine")
    if not entry or entry["id"] in seen:
        return None, ""
    from v100plan.errors import DocumentError

    if entry["id"] not in others:
        raise DocumentError(f"engine profile {doc['id']}", f"stand_in_engine {entry['id']!r} is not among the engine "
                            "profiles given", json_path="$.stand_in_engine.id",
                            hint=f"name one of {', '.join(sorted(others)) or 'the catalogue engines'}, or remove stand_in_engine")
    return engine_from_doc(others[entry["id"]], others, seen + (doc["id"],)), entry.get("source", "")


def engine_from_doc(doc: dict[str, Any], others: Mapping[str, dict[str, Any]] | None = None,
                    _seen: tuple[str, ...] = ()) -> Engine:
    """The Engine for a validated engine_profile document. Its ``stand_in_engine`` (if any) is read from ``others``
    (engine id -> document, e.g. the catalogue's); without them the profile has no stand-in."""
    eff = doc.get("efficiency", {})
    stand_in, stand_in_source = (_stand_in_engine(doc, others, _seen + (doc["id"],)) if others is not None
                                 else (None, ""))
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
        by_generation={gen: _generation(entry) for gen, entry in (doc.get("by_generation") or {}).items()},
        acceptance_definition=spec.get("acceptance_definition", "per_token"),
        acceptance_source=spec.get("acceptance_definition_source", ""),
        acceptance_by_workload={k: float(v) for k, v in (spec.get("acceptance_by_workload") or {}).items() if k != "source"},
        kv_cache_dtype=doc.get("kv_cache_dtype"), launch_kind=doc.get("launch_kind", ""),
        max_tp=int(doc.get("max_tp", 2)), multi_node=bool(doc.get("multi_node", False)),
        max_concurrency=(doc.get("max_concurrency") or {}).get("value"),
        max_concurrency_source=(doc.get("max_concurrency") or {}).get("source", ""),
        batched_step=_batched_step(doc.get("batched_step")),
        aliases=tuple(doc.get("aliases") or ()), generic_generations=tuple(doc.get("calibrated_generations") or ()),
        tp_output_head=(doc.get("tp_output_head") or {}).get("value", "split"),
        tp_output_head_source=(doc.get("tp_output_head") or {}).get("source", "default: vocab parallel"),
        allreduce_path=(doc.get("allreduce_path") or {}).get("value", "nccl"),
        allreduce_path_source=(doc.get("allreduce_path") or {}).get("source", "default: NCCL"),
        round_overhead_per_layer_ms=_sourced(eff.get("round_overhead_per_layer_ms"), missing),
        stand_in_engine=stand_in, stand_in_engine_source=stand_in_source,
        calibration_card=dict(doc.get("calibration_card") or {}), kernel_model=dict(doc.get("kernel_model") or {}),
        strategies=tuple((doc.get("strategies") or {}).get("value") or ()),
        formats=tuple((doc.get("formats") or {}).get("supported") or ()),
        bundled=bool((doc.get("distribution") or {}).get("bundled", False)),
        where=str((doc.get("distribution") or {}).get("where", "")),
    )


def _generation(entry: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("weight_bw_fraction", "kv_bw_fraction", "round_overhead_ms", "round_overhead_per_layer_ms"):
        if key in entry:
            out[key] = _sourced(entry[key])
    out["weight_bw_fraction_by_format"] = {k: _sourced(v) for k, v in (entry.get("weight_bw_fraction_by_format") or {}).items()}
    return out
