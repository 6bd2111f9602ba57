"""`v100plan plan`, `v100plan compare` and the `v100plan profiles` group.

Each command: declare options, validate them, make one library call (v100plan.planning), render a
table or emit one JSON document.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from v100plan import catalogue, output, render_plan
from v100plan.errors import DocumentError, UnknownId
from v100plan.options import JsonOpt, OutOpt
from v100plan.planning import (
    DEFAULT_CONTEXT,
    DEFAULT_HARDWARE,
    DEFAULT_MODEL,
    DEFAULT_WORKLOAD,
    compare_document,
    listing_document,
    plan_document,
    profile_rows,
    validation_document,
)


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_cmd(
        hardware: Annotated[str, typer.Option("--hardware", help="Catalogue hardware id, or a probe report JSON file.")] = DEFAULT_HARDWARE,
        gpus: Annotated[Optional[int], typer.Option("--gpus", help="Number of cards (default 2; a probe report's card count).")] = None,
        model: Annotated[str, typer.Option("--model", help="Catalogue model id, a Hugging Face config.json, or a model directory holding one.")] = DEFAULT_MODEL,
        engine: Annotated[Optional[str], typer.Option("--engine", help="v100plan (the bundled engine), or an external one: llamacpp, vllm, sglang, ninfer-v100-tp (or another catalogue id), or an engine profile JSON file (default: the bundled engine v100plan, the one you can launch; an external engine only when asked).")] = None,
        context: Annotated[str, typer.Option("--context", help="Context length in tokens: 186000, 186K, 256K (K = 1024).")] = DEFAULT_CONTEXT,
        weights: Annotated[Optional[str], typer.Option("--weights", help="Weight format: fp32 fp16 bf16 fp8 int8 int4-awq int4-gptq nvfp4 q8_0 q6_k q5_k_m q4_k_m q4_0 iq4_xs q3_k_m q2_k (a catalogue model keeps its own unless given).")] = None,
        kv_cache_dtype: Annotated[Optional[str], typer.Option("--kv-cache-dtype", help="KV cache type: fp16 bf16 fp8 int8 q8_0 q4_0 (default: the engine's).")] = None,
        draft_tokens: Annotated[Optional[int], typer.Option("--draft-tokens", help="Draft tokens k per round (the model's MTP head, or --draft-model).")] = None,
        draft_model: Annotated[Optional[str], typer.Option("--draft-model", help="A separate draft model: catalogue id, config.json or directory.")] = None,
        nodes: Annotated[int, typer.Option("--nodes", help="Boxes of --gpus cards each (more than one: TP within a box, pipeline across).")] = 1,
        workload: Annotated[str, typer.Option("--workload", help="prose or code: which of the model's draft acceptance figures speculation is planned with (code prompts accept more drafts).")] = DEFAULT_WORKLOAD,
        acceptance: Annotated[Optional[float], typer.Option("--acceptance", help="Draft acceptance A, as the engine profile defines it: per token, tokens/round = (1 - A^(k+1)) / (1 - A); or the share of drafts accepted, 1 + k x A (default: the profile's).")] = None,
        concurrency: Annotated[int, typer.Option("--concurrency", help="Sequences decoded together by each engine instance.")] = 1,
        objective: Annotated[str, typer.Option("--objective", help="Recommend by one-stream decode speed (latency) or by aggregate tok/s of all streams (throughput).")] = "latency",
        json_out: JsonOpt = False,
        out: OutOpt = None,
    ) -> None:
        """How to run a model on these cards: every strategy, its speed beside the ceiling, and why."""
        output.check_out(out)
        doc = plan_document(hardware, gpus, model, engine, context, acceptance, concurrency, objective, weights,
                            kv_cache_dtype, draft_tokens, draft_model, nodes, workload)
        output.write_json(out, doc)
        if json_out:
            output.emit_json(doc)
        else:
            render_plan.print_all(render_plan.plan_renderables(doc))
        if not any(s["fits"] for s in doc["strategies"]):
            raise typer.Exit(1)  # exit code 1: no strategy fits (the document above names the nearest fit)

    @app.command("compare")
    def compare_cmd(
        hardware: Annotated[list[str], typer.Argument(help="Hardware as ID or IDxN (N cards), e.g. v100-pg500-216x2 rtx4090-48g.")],
        model: Annotated[str, typer.Option("--model", help="Catalogue model id, a Hugging Face config.json, or a model directory.")] = DEFAULT_MODEL,
        engine: Annotated[Optional[str], typer.Option("--engine", help="Catalogue engine id, or an engine profile JSON file (default: the bundled engine v100plan).")] = None,
        context: Annotated[str, typer.Option("--context", help="Context length in tokens (K = 1024).")] = DEFAULT_CONTEXT,
        weights: Annotated[Optional[str], typer.Option("--weights", help="Weight format (see `plan --help`).")] = None,
        kv_cache_dtype: Annotated[Optional[str], typer.Option("--kv-cache-dtype", help="KV cache type: fp16 bf16 fp8 int8 q8_0 q4_0.")] = None,
        workload: Annotated[str, typer.Option("--workload", help="prose or code: the model's draft acceptance figure to plan with.")] = DEFAULT_WORKLOAD,
        acceptance: Annotated[Optional[float], typer.Option("--acceptance", help="Per-draft-token acceptance A (default: the model's figure for --workload).")] = None,
        objective: Annotated[str, typer.Option("--objective", help="Pick each box's best strategy by one-stream decode speed (latency) or aggregate tok/s (throughput).")] = "latency",
        json_out: JsonOpt = False,
        out: OutOpt = None,
    ) -> None:
        """Boxes side by side: best strategy, decode tok/s, prefill, max context, price per tok/s."""
        output.check_out(out)
        doc = compare_document(list(hardware), model, engine, context, acceptance, objective, weights, kv_cache_dtype,
                               workload)
        output.write_json(out, doc)
        if json_out:
            output.emit_json(doc)
        else:
            render_plan.print_all(render_plan.compare_renderables(doc))

    profiles_app = typer.Typer(help="The catalogue: list, show and validate profiles.", no_args_is_help=True)
    app.add_typer(profiles_app, name="profiles")

    @profiles_app.command("list")
    def profiles_list(json_out: JsonOpt = False) -> None:
        """Every catalogued hardware, model and engine id, with its name and status."""
        doc = listing_document()
        if json_out:
            output.emit_json(doc)
            return
        output.render(output.table("v100plan catalogue", ["catalogue", "id", "name", "status"],
                                   [[e["catalogue"], e["id"], e["name"], e.get("status")] for e in doc["entries"]]))

    @profiles_app.command("show")
    def profiles_show(id_: Annotated[str, typer.Argument(metavar="ID", help="A hardware, model or engine id.")],
                      json_out: JsonOpt = False) -> None:
        """Print one profile as field/value tables with its sources (--json: the document itself)."""
        for c in ("hardware", "model", "engine"):
            if id_ in catalogue.ids(c):
                doc = catalogue.get(c, id_)
                if json_out:
                    output.emit_json(doc)
                    return
                fields, sources = profile_rows(doc)
                output.render(output.table(f"{c} profile {id_}", ["field", "value"], fields))
                if sources:
                    output.render(output.table("sources", ["field", "source"], sources))
                return
        every = [i for c in ("hardware", "model", "engine") for i in catalogue.ids(c)]
        raise UnknownId("profile", id_, every)

    @profiles_app.command("validate")
    def profiles_validate(
        files: Annotated[Optional[list[str]], typer.Argument(help="JSON files; none = the whole catalogue.")] = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Check documents against their schema (and catalogue files against the source rule)."""
        doc = validation_document([Path(f) for f in files] if files else None)
        results = doc["files"]
        bad = [r for r in results if r["problems"]]
        if json_out:
            output.emit_json(doc)
        else:
            rows = []
            for r in results:
                if not r["problems"]:
                    rows.append([r["file"], r["kind"], "ok", ""])
                for pr in r["problems"]:
                    rows.append([r["file"], r["kind"], pr["path"], pr["problem"]])
            output.render(output.table(None, ["file", "kind", "status / JSON path", "problem"], rows), to_stderr=False)
        if bad:
            raise DocumentError(bad[0]["file"], f"{len(bad)} of {len(results)} file(s) invalid; first: "
                                f"{bad[0]['problems'][0]['path']}: {bad[0]['problems'][0]['problem']}",
                                json_path=None, hint="fix the fields named above; the schemas are in profiles/schema/")


