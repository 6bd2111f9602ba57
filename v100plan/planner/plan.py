"""``plan(hardware, model, engine, target) -> Plan``: every strategy, the recommended one, and why.

Pure: no I/O, no clocks. Reads like the arithmetic on a whiteboard; the
``breakdown`` of each strategy keeps every term so the renderer can show it.
"""

from __future__ import annotations

from dataclasses import replace

from v100plan.planner import allreduce as ar
from v100plan.planner import batch_step, calibration, card_scaling, nearest, uncertainty
from v100plan.planner.decode import Round, decode_round, read_ms, round_overhead_ms, tokens_per_round
from v100plan.planner.formats import weight_format
from v100plan.planner.inputs import Engine, Hardware, Model, Target
from v100plan.planner.launch import launch_commands, launch_dtype
from v100plan.planner.memory import Memory, max_context, memory_per_gpu, sequences_that_fit
from v100plan.planner.prefill import Prefill, chunks, prefill_time
from v100plan.planner.result import Plan, StrategyResult
from v100plan.planner.strategies import NAMES, Layout, layout, wide_names
from v100plan.units import format_tokens, gib


def ctx_text(tokens: int) -> str:
    """A token count for people: exact K (K = 1024) when it is one, else whole K rounded down (what fits)."""
    if tokens % 1024 == 0 or tokens < 1024:
        return format_tokens(tokens)
    return f"{tokens // 1024}K ({tokens:,} tokens)"


def _memory_reason(mem: Memory, maxc: int, target: Target) -> str:
    ctx = format_tokens(target.context_tokens)
    terms = f"weights {gib(mem.weights_gb):.1f} + KV {gib(mem.kv_gb):.1f} + reserve {gib(mem.reserve_gb):.1f}"
    if maxc <= 0:
        return (f"weights {gib(mem.weights_gb):.1f} GiB + reserve {gib(mem.reserve_gb):.1f} GiB leave no room for KV "
                f"in {gib(mem.capacity_gb):.1f} GiB per GPU")
    return (f"needs {gib(mem.total_gb):.1f} GiB per GPU at {ctx} ({terms}) but the card has "
            f"{gib(mem.capacity_gb):.1f} GiB; "
            f"fits up to {ctx_text(maxc)}")


def _clock_ratio(hw: Hardware, lay: Layout) -> float:
    """A TP pair waits for its slowest card every layer (docs/field-figures.md), so only tp2 takes the pair's ratio."""
    if lay.tp == 2 and hw.pair.sm_clock_ratio.value is not None:
        return min(1.0, hw.pair.sm_clock_ratio.value)
    return 1.0


def _evaluate(name: str, hw: Hardware, model: Model, engine: Engine, target: Target,
              choice: ar.PathChoice | None, tpr: float, reserve_gb: float, verified_tokens: int,
              batch: batch_step.StepRatio | None = None) -> StrategyResult:
    """One strategy. ``batch`` (an engine with a measured batched step, concurrency > 1): the round is priced as
    ONE sequence's (weights once, one sequence's K/V and state) x batch.value (the step ratio; for speculating
    sequences, which take their rounds in turn, the concurrency); the ceilings stay the physical ones."""
    lay = layout(name, model, target.gpus, verified_tokens * target.concurrency,
                 head_replicated=engine.tp_output_head == "replicated")
    card = hw.card
    C = target.concurrency
    Cr = 1 if batch else C  # the sequences the priced round reads
    lay_r = layout(name, model, target.gpus, verified_tokens, head_replicated=engine.tp_output_head == "replicated") \
        if batch else lay
    mem = memory_per_gpu(model, lay, target.context_tokens, C, reserve_gb, card.memory_gb)
    maxc = max_context(model, lay, C, reserve_gb, card.memory_gb)
    path = choice.path if (lay.tp >= 2 and choice) else "none"
    problems: list[str] = []
    if lay.gpus_needed > target.gpus * hw.nodes:
        problems.append(f"needs {lay.gpus_needed} GPUs, {target.gpus * hw.nodes} given")
    if lay.tp > engine.max_tp:
        problems.append(f"engine {engine.id} runs tensor parallel up to {engine.max_tp}")
    if engine.formats and model.format not in engine.formats:
        problems.append(f"engine {engine.id} does not load {model.format} weights (it loads {', '.join(engine.formats)}): "
                        "pass --weights, or --engine for one that does")
    if engine.strategies and name not in engine.strategies:
        problems.append(f"engine {engine.id} does not run {name} (it runs {', '.join(engine.strategies)})")
    if engine.max_concurrency is not None and C > engine.max_concurrency:
        problems.append(f"engine {engine.id} decodes at most {engine.max_concurrency} sequence(s) at once: {C} concurrent "
                        f"requests would queue, not batch (plan --concurrency {engine.max_concurrency} or fewer, or "
                        "--engine vllm / sglang)")
    if lay.pp > 1 and not engine.multi_node:
        problems.append(f"engine {engine.id} does not run across nodes (vllm and sglang do)")
    if lay.tp >= 2 and target.gpus >= 2 and choice is None:
        problems.append("no usable allreduce path for this pair and engine")
    if target.context_tokens > model.native_context:
        problems.append(f"context {format_tokens(target.context_tokens)} exceeds the model's native "
                        f"{format_tokens(model.native_context)}")
    elif mem.total_gb > mem.capacity_gb:
        problems.append(_memory_reason(mem, maxc, target))
    breakdown = {
        "memory": {"weights_gb": round(mem.weights_gb, 3), "kv_gb": round(mem.kv_gb, 3), "reserve_gb": round(mem.reserve_gb, 3),
                   "capacity_gb": round(mem.capacity_gb, 3),
                   # the concurrent sequences the cards hold at this context (what concurrency could reach)
                   "sequences_that_fit": sequences_that_fit(model, lay, target.context_tokens, reserve_gb, card.memory_gb)},
    }
    base = dict(name=name, gpus_used=lay.gpus_needed if name != "replicas" else max(2, target.gpus),
                max_context=maxc, memory_per_gpu_gb=round(mem.total_gb, 2), allreduce_path=path, breakdown=breakdown)
    if problems:
        return StrategyResult(fits=False, decode_tok_s=None, aggregate_tok_s=None, decode_ceiling_tok_s=None,
                              aggregate_ceiling_tok_s=None, round_ms=None, prefill_s=None, reason="; ".join(problems), **base)

    reason = (f"{gib(mem.total_gb):.1f} of {gib(mem.capacity_gb):.1f} GiB per GPU at {format_tokens(target.context_tokens)}; "
              f"up to {ctx_text(maxc)} ({'native limit' if maxc >= model.native_context else 'memory limit'})")
    if lay.tp == 2 and choice:
        reason += f"; {choice.path} allreduce"
    if name == "replicas":
        reason += f"; {lay.streams} independent streams, none faster than one card"
    if name == "layer_split":
        reason += "; cards take turns, no faster than one card"
    fmt = weight_format(model.format)
    speeds = calibration.resolve(engine, model.format, fmt.family if fmt else "", card.architecture, lay.tp, card=card,
                                 kv_dtype=model.kv_dtype)
    fw, fk, oh = speeds.weight, speeds.kv, speeds.overhead
    scale = card_scaling.to_card(speeds.engine, card, fw, fk)
    fw, fk = scale.weight, scale.kv
    # The K/V a round reads grows with the context; a recurrent (GDN) state is a fixed-size block read whole, every
    # round, by the layer's own kernels like a weight matrix: it is read at the weight fraction, not the attention one.
    kv_read_gb = C * model.kv_bytes_at(target.context_tokens) * lay.kv_read_share / 1e9
    state_read_gb = C * model.state_bytes_per_sequence * lay.kv_read_share / 1e9
    weights_gb = lay.weights_read_gb + state_read_gb
    ceiling_ms = read_ms(weights_gb + kv_read_gb, card.read_bw.value)
    missing = [n for n, v in (("weight_bw_fraction", fw), ("kv_bw_fraction", fk), ("round_overhead_ms", oh)) if v.value is None]
    if missing:
        reason += f"; no speeds: engine {engine.id} lacks {', '.join(missing)} (run `v100plan bench engine`); ceiling shown"
        breakdown["decode"] = {"bandwidth_gbps": card.read_bw.value, "weights_read_gb": round(weights_gb, 3),
                               "kv_read_gb": round(kv_read_gb, 3), "tokens_per_round": round(tpr, 4),
                               "ceiling_ms": round(ceiling_ms, 3)}
        ceiling = tpr / ceiling_ms * 1e3
        return StrategyResult(fits=True, decode_tok_s=None, aggregate_tok_s=None, decode_ceiling_tok_s=round(ceiling, 2),
                              aggregate_ceiling_tok_s=round(ceiling * C * lay.streams, 2), round_ms=None, prefill_s=None,
                              reason=reason, **base)

    ceiling_read_gb = weights_gb + kv_read_gb  # the physical floor: weights once, C sequences' K/V and state
    if batch:
        kv_read_gb = Cr * model.kv_bytes_at(target.context_tokens) * lay_r.kv_read_share / 1e9
        weights_gb = lay_r.weights_read_gb + Cr * model.state_bytes_per_sequence * lay_r.kv_read_share / 1e9
    ratio = _clock_ratio(hw, lay)
    ar_us, ar_source = None, None
    if lay.tp > 2:
        # Wider than two: the box's figure for this many cards, else log2(tp) two-card allreduces (allreduce.py).
        wide = ar.wide_allreduce(hw, engine, lay.tp, model.allreduce_bytes_per_token * verified_tokens * Cr, choice)
        ar_us, ar_source = wide.us, wide.source
        base["allreduce_path"] = wide.path
    elif lay.tp == 2 and choice:
        ar_us, ar_source = choice.decode_us, choice.source
    ar_ms = ar.allreduce_ms_per_round(model.allreduces_per_round, ar_us) if ar_us is not None else 0.0
    hop_us = choice.decode_us if choice else 0.0
    if lay.pp > 1:
        net = hw.network
        hop_us = (net.latency_us + model.allreduce_bytes_per_token * verified_tokens * Cr / (net.bw_gbps * 1e3)) if net else 0.0
    per_layer = speeds.per_layer.value
    overhead_ms = round_overhead_ms(oh.value, per_layer, model.layers) * scale.overhead_factor
    draft_ms = _draft_ms(model, engine, card.read_bw.value, fw.value, oh.value, per_layer, verified_tokens - 1)
    verify_ms = _verify_compute_ms(model, engine, hw, verified_tokens * Cr, lay.tp)
    rnd: Round = decode_round(
        weights_gb=weights_gb, kv_gb=kv_read_gb, bw_gbps=card.read_bw.value, weight_fraction=fw.value,
        kv_fraction=fk.value, overhead_ms=overhead_ms, clock_ratio=ratio,
        allreduce_ms=ar_ms, hops_ms=lay.hops_per_round * hop_us / 1e3, tpr=tpr, draft_ms=draft_ms, verify_compute_ms=verify_ms,
    )
    breakdown["decode"] = {
        "bandwidth_gbps": card.read_bw.value, "weights_read_gb": round(weights_gb, 3), "kv_read_gb": round(kv_read_gb, 3),
        "weight_bw_fraction": fw.value, "kv_bw_fraction": fk.value,
        "fractions_source": {"weight": fw.source, "kv": fk.source},
        "speeds_engine": speeds.engine.id, "speeds_calibrated": speeds.stand_in is None,
        "weights_ms": round(rnd.weights_ms, 3), "kv_ms": round(rnd.kv_ms, 3), "overhead_ms": round(rnd.overhead_ms, 3),
        "allreduce_ms": round(rnd.allreduce_ms, 3), "hops_ms": round(rnd.hops_ms, 3),
        "allreduces_per_round": model.allreduces_per_round if lay.tp >= 2 else 0,
        "allreduce_us": round(ar_us, 2) if ar_us is not None else None,
        "allreduce_source": ar_source,
        "clock_ratio": ratio, "tokens_per_round": round(tpr, 4), "ceiling_ms": round(rnd.ceiling_ms, 3),
    }
    if per_layer is not None:
        breakdown["decode"].update(overhead_constant_ms=oh.value, overhead_per_layer_ms=per_layer, layers=model.layers)
    if rnd.draft_ms:
        breakdown["decode"]["draft_ms"] = round(rnd.draft_ms, 3)
    round_ms, ceiling_tok_s = rnd.total_ms, rnd.ceiling_tok_s
    if batch:
        round_ms = rnd.total_ms * batch.value
        ceiling_tok_s = tpr / read_ms(ceiling_read_gb, card.read_bw.value) * 1e3
        breakdown["decode"].update(
            one_sequence_round_ms=round(rnd.total_ms, 3), ceiling_read_gb=round(ceiling_read_gb, 3),
            ceiling_ms=round(read_ms(ceiling_read_gb, card.read_bw.value), 3), batch_step_how=batch.how,
            batch_step_basis=batch.basis, batch_step_source=batch.source,
            **({"batch_step_ratio": round(batch.value, 4), "batch_step_family": batch.family} if batch.kind == "batched"
               else {"rounds_in_turn": C}))
    prefill_s, prefill_breakdown, why_not = _prefill(hw, model, engine, target, choice, lay, ratio)
    if prefill_breakdown:
        breakdown["prefill"] = prefill_breakdown
    if why_not:
        reason += f"; no prefill estimate: {why_not}"
    elif model.vision:
        breakdown["image"] = _image_prefill(hw, model, engine, lay.tp, ratio)
    per_stream = tpr / round_ms * 1e3
    return StrategyResult(
        fits=True, decode_tok_s=round(per_stream, 2), aggregate_tok_s=round(per_stream * C * lay.streams, 2),
        decode_ceiling_tok_s=round(ceiling_tok_s, 2), aggregate_ceiling_tok_s=round(ceiling_tok_s * C * lay.streams, 2),
        round_ms=round(round_ms, 3), prefill_s=prefill_s, reason=reason, **base,
    )


def _draft_ms(model: Model, engine: Engine, bw_gbps: float, fw: float, overhead_ms: float, per_layer_ms: float | None,
              k: int) -> float:
    """k draft steps: each reads the draft's bytes at the engine's weight fraction; a separate draft
    model also pays the engine's per-round overhead each step (its per-layer part over the draft's own
    layers, the target's where the draft's are not known: said in the plan). An MTP head whose bytes the
    profile does not give is inside the engine's calibrated weight reads (0 here, said in the plan)."""
    if k <= 0 or model.draft_read_gb is None:
        return 0.0
    step = read_ms(model.draft_read_gb, bw_gbps, fw)
    if model.draft_kind == "model":
        step += round_overhead_ms(overhead_ms, per_layer_ms, model.draft_layers or model.layers)
    return k * step


def _verify_compute_ms(model: Model, engine: Engine, hw: Hardware, tokens: int, tp: int) -> float:
    """(k + 1) x concurrency tokens x matrix FLOPs per token / (tensor peak x prefill_compute_fraction) / tp:
    the verification's compute, which the weight read hides unless it is longer (0 when not known)."""
    peak, frac = hw.card.tensor_tflops.value, engine.prefill_compute_fraction.value
    if tokens <= 1 or not peak or not frac:
        return 0.0
    return tokens * model.matrix_flops_per_token / (peak * 1e12 * frac) / tp * 1e3


def _image_prefill(hw: Hardware, model: Model, engine: Engine, tp: int, ratio: float) -> dict:
    """What one image adds to a request's time to first token, at the prefill's compute rate: the tower's matrix
    FLOPs (whole on every rank: not divided by tp) and its image tokens through the decoder's matrices (split).
    A floor like the prefill's: the H100 measured the tower at 1.54x such a figure (docs/vision.md)."""
    rate = hw.card.tensor_tflops.value * 1e12 * engine.prefill_compute_fraction.value * ratio
    v = model.vision or {}
    tower_ms = v["tower_flops"] / rate * 1e3
    tokens_ms = v["image_tokens"] * model.matrix_flops_per_token / rate / tp * 1e3
    return {"image_pixels": v["image_pixels"], "image_tokens": v["image_tokens"], "tower_ms": round(tower_ms, 2),
            "tokens_ms": round(tokens_ms, 2), "total_ms": round(tower_ms + tokens_ms, 2)}


def _prefill(hw: Hardware, model: Model, engine: Engine, target: Target, choice: ar.PathChoice | None, lay: Layout,
             ratio: float) -> tuple[float | None, dict | None, str | None]:
    """Time to first token for the target context: (seconds, breakdown, None) or (None, None, why not)."""
    if engine.missing_for_prefill():
        return None, None, f"engine {engine.id} lacks {', '.join(engine.missing_for_prefill())}"
    if hw.card.tensor_tflops.value is None:
        return None, None, hw.card.tensor_tflops.source
    n_chunks = chunks(target.context_tokens, engine.prefill_chunk_tokens)
    comm_s = 0.0
    if choice and lay.tp == 2:
        comm_s = n_chunks * model.allreduces_per_round * choice.prefill_us / 1e6
    elif choice and lay.hops_per_round:
        comm_s = n_chunks * lay.hops_per_round * choice.prefill_us / 1e6
    pf: Prefill = prefill_time(model, target.context_tokens, hw.card.tensor_tflops.value, engine.prefill_compute_fraction.value,
                               engine.prefill_attention_fraction.value, ratio, lay.tp, comm_s)
    return round(pf.total_s, 2), {"tensor_tflops": hw.card.tensor_tflops.value, "matrix_s": round(pf.matrix_s, 3),
                                  "attention_s": round(pf.attention_s, 3), "comm_s": round(pf.comm_s, 3),
                                  "chunks": n_chunks, "clock_ratio": ratio}, None


def _recommend(results: list[StrategyResult], objective: str) -> str | None:
    fitting = [r for r in results if r.fits and r.decode_tok_s is not None]
    if not fitting:
        return None
    if objective == "throughput":
        key = lambda r: (r.aggregate_tok_s, r.decode_tok_s, -r.gpus_used)  # noqa: E731
    else:
        key = lambda r: (r.decode_tok_s, r.aggregate_tok_s, -r.gpus_used)  # noqa: E731
    return max(fitting, key=key).name


def _why(r: StrategyResult, hw: Hardware, model: Model, engine: Engine, target: Target,
         choice: ar.PathChoice | None, acceptance: float, k: int, definition: str) -> list[str]:
    """The arithmetic of one strategy, line by line, for a person to check."""
    d, m = r.breakdown.get("decode"), r.breakdown["memory"]
    ctx = format_tokens(target.context_tokens)
    lines = [f"bandwidth {hw.card.read_bw.value:g} GB/s ({hw.card.read_bw.source})"]
    if d:
        one = "one_sequence_round_ms" in d  # a round of several sequences priced from the engine's measured step
        fw_tp2 = " (tp2 figure)" if r.name == "tp2" and engine.tp2_weight_bw_fraction.value is not None else ""
        fk_tp2 = " (tp2 figure)" if r.name == "tp2" and engine.tp2_kv_bw_fraction.value is not None else ""
        lines += [
            f"weights read per round {d['weights_read_gb']:.2f} GB / ({d['bandwidth_gbps']:g} GB/s x {d['weight_bw_fraction']:g}"
            f"{fw_tp2}) = {d['weights_ms']:.2f} ms",
            f"KV read at {ctx}: {d['kv_read_gb']:.2f} GB / ({d['bandwidth_gbps']:g} GB/s x {d['kv_bw_fraction']:g}{fk_tp2}) "
            f"= {d['kv_ms']:.2f} ms ({model.kv_bytes_per_token:.0f} bytes/token x {1 if one else target.concurrency} sequence(s))",
            _overhead_line(d, engine),
        ]
        if d["allreduce_ms"]:
            lines.append(f"allreduce {d['allreduces_per_round']} x {d['allreduce_us']:g} us ({r.allreduce_path}) = "
                         f"{d['allreduce_ms']:.2f} ms; figure from {d.get('allreduce_source') or 'n/a'}")
        if d["hops_ms"]:
            lines.append(f"hand-overs between cards {d['hops_ms']:.3f} ms")
        if d.get("draft_ms"):
            lines.append(f"{k} draft step(s) ({model.draft_kind}) {d['draft_ms']:.2f} ms")
        formula = (f"(1 - {acceptance:g}^{k + 1}) / (1 - {acceptance:g})" if definition == "per_token" and k
                   else f"1 + {k} x {acceptance:g}")
        if one and "batch_step_ratio" in d:
            lines.append(f"{target.concurrency} sequences in one batched step: one-sequence round "
                         f"{d['one_sequence_round_ms']:.2f} ms x step ratio {d['batch_step_ratio']:g} ({d['batch_step_how']}: "
                         f"{d['batch_step_basis']}) = {r.round_ms:.2f} ms")
        elif one:
            lines.append(f"{d['rounds_in_turn']} speculating sequences take their rounds in turn: "
                         f"{d['rounds_in_turn']} x {d['one_sequence_round_ms']:.2f} ms = {r.round_ms:.2f} ms between one "
                         "request's rounds (an upper bound: the eager per-slot round is not measured)")
        ceiling_gb = (f"{d['ceiling_read_gb']:.2f} GB ({target.concurrency} sequences' K/V)" if one
                      else f"{d['weights_read_gb']:.2f} + {d['kv_read_gb']:.2f} GB")
        lines += [
            f"round {r.round_ms:.2f} ms; tokens per round {formula} = {d['tokens_per_round']:g}; "
            f"decode {d['tokens_per_round']:g} / {r.round_ms:.2f} ms = {r.decode_tok_s:.1f} tok/s per stream",
            f"ceiling {d['tokens_per_round']:g} / ({ceiling_gb} / {d['bandwidth_gbps']:g} GB/s "
            f"= {d['ceiling_ms']:.2f} ms) = {r.decode_ceiling_tok_s:.1f} tok/s",
        ]
    lines.append(f"memory per GPU: weights {gib(m['weights_gb']):.2f} + KV {gib(m['kv_gb']):.2f} + reserve "
                 f"{gib(m['reserve_gb']):.2f} = {gib(r.memory_per_gpu_gb):.2f} GiB of {gib(m['capacity_gb']):.2f} GiB; "
                 f"max context {ctx_text(r.max_context)}")
    p = r.breakdown.get("prefill")
    if p:
        lines.append(f"prefill {ctx}: matrix {p['matrix_s']:.1f} s + attention {p['attention_s']:.1f} s + communication "
                     f"{p['comm_s']:.1f} s = {r.prefill_s:.1f} s at {p['tensor_tflops']:g} TFLOPS peak "
                     f"x {engine.prefill_compute_fraction.value:g} (matrix) / {engine.prefill_attention_fraction.value:g} (attention)")
    return lines


def _overhead_line(d: dict, engine: Engine) -> str:
    """The round's overhead as the arithmetic: fixed, or per layer x every layer (not divided by tp or stages)."""
    stretch = f", stretched by clock ratio {d['clock_ratio']:g}" if d["clock_ratio"] < 1 else ""
    who = d.get("speeds_engine", engine.id)
    who = who if who == engine.id else f"{who}, standing in for {engine.id}"
    if "overhead_per_layer_ms" not in d:
        return f"fixed per-round overhead {d['overhead_ms']:.2f} ms (engine {who}{stretch})"
    const = f" + {d['overhead_constant_ms']:g} ms" if d["overhead_constant_ms"] else ""
    unstretched = d["overhead_constant_ms"] + d["overhead_per_layer_ms"] * d["layers"]
    total = f"{unstretched:.2f} ms" + (f", {d['overhead_ms']:.2f} ms" if stretch else "")
    return (f"per-round overhead {d['overhead_per_layer_ms']:g} ms x {d['layers']} layers{const} = {total} "
            f"(engine {who}, per layer: every rank and every stage runs all of them{stretch})")


def _acceptance(model: Model, engine: Engine, target: Target, k: int) -> tuple[float, str, str]:
    """(acceptance, its definition, where it comes from): --acceptance (as the engine defines it), else the model's
    figure for the workload (the field's share of drafts accepted: 1 + k x A), else the engine's default."""
    if target.acceptance is not None:
        return target.acceptance, engine.acceptance_definition, "--acceptance"
    if not k:
        return 0.0, engine.acceptance_definition, "no drafts"
    if target.workload in model.acceptance:
        return (model.acceptance[target.workload], "accepted_share",
                f"workload {target.workload}: {model.id}'s figure, a share of drafts accepted")
    why = (f"{model.id} has no {target.workload} figure" if model.acceptance else f"{model.id} has no acceptance figures")
    if target.workload in engine.acceptance_by_workload:
        return (engine.acceptance_by_workload[target.workload], "accepted_share",
                f"workload {target.workload}: engine {engine.id}'s figure for the 27B hybrid's MTP layer, a share of drafts "
                f"accepted ({why})")
    return engine.default_acceptance, engine.acceptance_definition, f"engine {engine.id}'s default: {why}"


def plan(hardware: Hardware, model: Model, engine: Engine, target: Target, alternatives: tuple[Model, ...] = (),
         bands: dict | None = None) -> Plan:
    """Plan ``model`` on ``hardware`` with ``engine`` for ``target``; ``alternatives`` (other formats of the
    model) are only used to name the nearest configuration that fits when nothing does; ``bands`` (the
    prediction_intervals document) gives every prediction its p10-p90 interval (uncertainty.py)."""
    result = plan_strategies(hardware, model, engine, target, bands)
    if not any(r.fits for r in result.strategies):
        result = replace(result, nearest_fit=nearest.nearest_fit(hardware, model, engine, target, alternatives,
                                                                 plan_strategies))
    return result


def _with_intervals(r: StrategyResult, bands: dict | None, rung: str, unmodelled: bool) -> StrategyResult:
    """The strategy with its p10-p90 intervals and time to first token (uncertainty.py)."""
    if not r.fits or r.decode_tok_s is None:
        return r
    db = uncertainty.band(bands, "decode", rung, unmodelled)
    pb = uncertainty.band(bands, "prefill", rung, unmodelled)
    ttft = round(r.prefill_s + r.round_ms / 1e3, 2) if r.prefill_s is not None and r.round_ms is not None else None
    scale = (r.aggregate_tok_s / r.decode_tok_s) if r.aggregate_tok_s and r.decode_tok_s else 1.0
    dec = uncertainty.interval(r.decode_tok_s, db, r.decode_ceiling_tok_s)
    return replace(r, decode_tok_s_interval=dec,
                   aggregate_tok_s_interval=[round(v * scale, 2) for v in dec] if dec else None,
                   prefill_s_interval=uncertainty.time_interval(r.prefill_s, pb), ttft_s=ttft,
                   ttft_s_interval=uncertainty.time_interval(ttft, pb),
                   interval_source="; ".join(b.source for b in (db, pb) if b) or None)


def unmodelled_structures(model: Model) -> list[str]:
    """What the model declares that the planner does not price (its 'unmodelled: X' assumptions)."""
    return [a.removeprefix("unmodelled: ") for a in model.assumptions if a.startswith("unmodelled: ")]


def _batch_pricing(model: Model, engine: Engine, target: Target, k: int) -> tuple[batch_step.StepRatio | None, list[str]]:
    """How a round of several sequences is priced where the engine's batched step is measured (batch_step.py):
    (the step ratio or the speculative rounds in turn, the notes that say so); (None, []) for one sequence or an
    engine without the table (C sequences' reads, weights once)."""
    C = target.concurrency
    if C <= 1 or engine.batched_step is None:
        return None, []
    if k:
        return batch_step.in_turn(C), [
            f"engine {engine.id} does not batch speculating sequences ({batch_step.SPECULATIVE_SOURCE}): with {C} "
            f"requests each takes its own round in turn, so per request = the one-sequence speculative round's tok/s / "
            f"{C} and aggregate = that round's tok/s; an upper bound: the eager per-slot round's extra cost over the "
            "graph round priced here is not measured"]
    fmt = model.format
    r = batch_step.step_ratio(engine.batched_step, fmt, C, target.context_tokens)
    if r is None:
        return None, [f"engine {engine.id}'s batched step is not measured for {fmt} weights: {C} sequences priced by "
                      "their reads (weights once, each sequence's K/V), which the measured step is far slower than"]
    return r, [f"engine {engine.id} decodes {C} sequences in one batched step: each round is the one-sequence round x "
               f"{r.value:.3f}, the batched step's time over the one-sequence step's ({r.how}: {r.basis}); "
               f"from {r.source}; {engine.batched_step.note}"]


def plan_strategies(hardware: Hardware, model: Model, engine: Engine, target: Target, bands: dict | None = None) -> Plan:
    """Every strategy, the recommended one and its arithmetic (no search for a nearest fit)."""
    notes = list(hardware.notes) + [f"model: {a}" for a in model.assumptions]
    if target.draft_tokens is not None:
        k = target.draft_tokens if model.max_draft_tokens else 0
        if target.draft_tokens and not model.max_draft_tokens:
            notes.append(f"{model.id} has no MTP head and no draft model was given (--draft-model): 1 token per round")
    else:
        k = min(engine.draft_tokens, model.max_draft_tokens)
        if engine.draft_tokens and not model.max_draft_tokens:
            notes.append(f"{model.id} has no draft layer: no speculative decoding (1 token per round)")
    acceptance, definition, acceptance_source = _acceptance(model, engine, target, k)
    if k:
        notes.append(f"acceptance {acceptance:g} per draft token ({acceptance_source})")
    tpr = tokens_per_round(k, acceptance, definition)
    fmt = weight_format(model.format)
    speeds = calibration.resolve(engine, model.format, fmt.family if fmt else "", hardware.card.architecture, 1,
                                 card=hardware.card, kv_dtype=model.kv_dtype)
    speeds_record = speeds.record(engine.id, hardware.card.architecture, model.format)
    if (k and model.draft_kind == "model" and not model.draft_layers
            and speeds.per_layer.value is not None):
        notes.append(f"engine {engine.id} pays its overhead per layer: the draft model's layer count is not known, "
                     f"so each draft step is priced at {model.id}'s {model.layers} layers (an upper bound)")
    # A draft head without a byte count (the catalogue 27B's MTP layer) is inside the engine's calibrated reads.
    notes += speeds.notes
    if note := card_scaling.to_card(speeds.engine, hardware.card, speeds.weight, speeds.kv).note:
        notes.append(note)
    if engine.runtime_reserve_gb.value is None:
        reserve = 0.0
        notes.append(f"runtime reserve unknown for engine {engine.id}: memory per GPU excludes it")
    else:
        reserve = engine.runtime_reserve_gb.value
    if not hardware.card.read_bw.source.startswith("measured"):
        notes.append(f"{hardware.card.id}: bandwidth is nominal, not measured; run `v100plan probe` for a measured figure")
    # Where the engine's batched step is measured, a round of several sequences is priced from the one-sequence
    # round, whose allreduces carry one sequence's tokens.
    batch, batch_notes = _batch_pricing(model, engine, target, k)
    notes += batch_notes
    choice = None
    if hardware.gpus >= 2 or target.gpus >= 2:
        decode_bytes = (k + 1) * model.allreduce_bytes_per_token * (1 if batch else target.concurrency)
        prefill_bytes = engine.prefill_chunk_tokens * model.allreduce_bytes_per_token
        choice = ar.choose_path(hardware, engine, decode_bytes, prefill_bytes)
        if choice is None and (engine.multi_node or engine.max_tp > 2):
            # Engines with their own NCCL allreduce (vLLM, SGLang, gpt-fast): without a figure for this box it is not priced.
            choice = ar.PathChoice("nccl", 0.0, "nccl", 0.0, "no allreduce figure for this box: not priced", ())
            wider = sorted(n for n in hardware.box_allreduce_us if n > 2)
            own = engine.allreduce_path
            uses = "NCCL" if own == "nccl" else f"{own} (NCCL where that cannot run)"
            notes.append(f"allreduce: engine {engine.id} uses {uses}; no two-card figure for {hardware.card.id}, so "
                         + ("two-card allreduces are" if wider else "allreduces are") + " not priced (run `v100plan probe` "
                         "on the box)" + (f"; {', '.join(map(str, wider))}-GPU figures are in its profile" if wider else ""))
        if choice:
            notes += [f"allreduce {why}" for why in choice.rejected]
            if choice.prefill_path != choice.path:
                notes.append(f"prefill chunks use {choice.prefill_path} ({choice.prefill_us:.0f} us per chunk-sized allreduce)")
    tp2_note = speeds.engine.tp2_fallback_note()
    if target.gpus >= 2 and tp2_note and speeds.complete:
        notes.append(tp2_note)
    if model.moe_experts and (k + 1) * target.concurrency > 1:
        notes.append(f"MoE: {(k + 1) * target.concurrency} tokens per round touch more experts than one "
                     "(uniform routing assumed)")
    names = NAMES + wide_names(target.gpus, hardware.nodes, engine.max_tp)
    if engine.allreduce_path != "nccl" and target.gpus >= 2:
        notes.append(f"engine {engine.id} runs its tensor-parallel allreduces on {engine.allreduce_path} "
                     f"({engine.allreduce_path_source}); priced from the box's figures for that path, NCCL's where it has none")
    if engine.tp_output_head == "replicated" and target.gpus >= 2:
        notes.append(f"engine {engine.id} keeps the output head whole on every rank under tensor parallel "
                     f"({engine.tp_output_head_source}): "
                     + (f"each rank reads all {model.head_gb:.2f} GB of it" if model.head_gb
                        else f"{model.id} does not give the head's size, so it is read as split"))
    if hardware.nodes > 1 and hardware.network is None:
        notes.append(f"{hardware.card.id}: no network figures between nodes in the hardware profile: pipeline hand-overs "
                     "across nodes are not priced (add 'network' bandwidth and latency)")
    for tp in sorted({int(n[2:].partition("_pp")[0]) for n in names if n.startswith("tp")} - {1, 2}):
        if found := ar.box_table(hardware, engine, tp, choice):
            notes.append(f"tp{tp}: each allreduce priced from {hardware.card.id}'s {tp}-GPU figure on {found.path} "
                         f"({found.source})")
        elif choice and choice.decode_us > 0:
            notes.append(f"tp{tp}: no {tp}-GPU allreduce figure for {hardware.card.id}: each allreduce priced as "
                         f"log2({tp}) two-card allreduces")
        else:
            notes.append(f"tp{tp}: no {tp}-GPU or two-card allreduce figure for {hardware.card.id}: allreduces not priced")
    results = [_evaluate(n, hardware, model, engine, target, choice, tpr, reserve, k + 1, batch) for n in names]
    rec = _recommend(results, target.objective)
    why: list[str] = []
    launch = None
    launch_for = rec
    dtype = launch_dtype(model.format, hardware.card.native_bf16)
    if rec is None and engine.launch_kind:
        # No speeds (uncalibrated engine): still give the commands, for the fitting strategy with the best ceiling.
        fitting = [r for r in results if r.fits and r.decode_ceiling_tok_s]
        if fitting:
            launch_for = max(fitting, key=lambda r: r.decode_ceiling_tok_s).name
            notes.append(f"launch commands for {launch_for}, the fitting strategy with the highest ceiling "
                         f"(engine {engine.id} has no speeds to rank by)")
    def _launch(name: str) -> dict:
        r = next(x for x in results if x.name == name)
        lay = layout(name, model, target.gpus, (k + 1) * target.concurrency)
        out = {"engine": engine.id, "strategy": name, "tp": lay.tp, "replicas": lay.streams, "gpus": r.gpus_used,
               "allreduce": r.allreduce_path, "max_context": target.context_tokens, "dtype": dtype,
               "kv_cache_dtype": model.kv_dtype or None, "concurrency": target.concurrency,
               "speculative": (model.draft_kind or "off") if k else "off", "draft_tokens": k,
               "acceptance": acceptance, "workload": target.workload, "bundled": engine.bundled}
        if not engine.bundled:
            out["where"] = engine.where or "not bundled: see the engine's profile"
        cmds = launch_commands(engine.launch_kind, model, lay, hardware.nodes, target, dtype, k)
        if cmds:
            out["commands"] = cmds
        return out

    results = [replace(r, launch=_launch(r.name)) if r.fits else r for r in results]
    unmodelled = unmodelled_structures(model)
    results = [_with_intervals(r, bands, uncertainty.rung(speeds.stand_in if speeds.complete else None), bool(unmodelled))
               for r in results]
    if unmodelled and bands:
        notes.append(f"unmodelled: {', '.join(unmodelled)}: the intervals are widened for it (the planner does not price it)")
    if launch_for and not rec:
        launch = _launch(launch_for)
    if rec:
        r = next(x for x in results if x.name == rec)
        why = _why(r, hardware, model, engine, target, choice, acceptance, k, definition)
        if line := calibration.stand_in_line(speeds_record):
            why = [line] + why
        launch = _launch(rec)
        if img := r.breakdown.get("image"):
            notes.append(f"an image ({img['image_tokens']} tokens for {img['image_pixels'] / 1e6:.2f} MP) adds about "
                         f"{img['total_ms']:.0f} ms to the time to first token on {rec}: the vision tower "
                         f"{img['tower_ms']:.0f} ms + its tokens {img['tokens_ms']:.0f} ms at the prefill's rate (a "
                         "floor: the tower measured 1.54x its figure on an H100, docs/vision.md)")
    if launch and not engine.bundled:
        notes.append(f"engine {engine.id} is external: not bundled with v100plan; get it from {launch['where']}"
                     + ("" if launch.get("commands") else " (no launch line: run it as its own documentation says)"))
    if launch and launch.get("commands"):
        notes += [f"launch ({c['node']}): " + " ".join([f"{k}={v}" for k, v in (c.get("env") or {}).items()] + c["argv"])
                  for c in launch["commands"]]
    inputs = {
        "hardware": hardware.origin, "card": hardware.card.id, "gpus": target.gpus, "model": model.id, "engine": engine.id,
        "context_tokens": target.context_tokens, "acceptance": acceptance, "draft_tokens": k,
        "concurrency": target.concurrency, "objective": target.objective, "workload": target.workload,
    }
    return Plan(inputs=inputs, strategies=tuple(results), recommended=rec, why=tuple(why), notes=tuple(notes), launch=launch,
                speeds=speeds_record)
