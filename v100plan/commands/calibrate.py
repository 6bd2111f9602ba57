"""`v100plan calibrate --endpoint URL`: measure a running OpenAI-compatible server's one-stream decode at several
contexts and write the EngineProfile that `plan --engine FILE` reads, with the plan's prediction beside each figure."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from v100plan import output, plan_inputs
from v100plan.accept.http import Client
from v100plan.api_key import read_api_key
from v100plan.calibrate import endpoint_profile
from v100plan.errors import BadInput
from v100plan.options import JsonOpt, OutOpt
from v100plan.planning import load_hardware


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise BadInput(f"--prompt-tokens {text!r} is not a comma-separated list of token counts",
                       hint="e.g. --prompt-tokens 64,512,2048") from None
    if len(sizes) < 2 or sizes[0] < 1:
        raise BadInput(f"--prompt-tokens needs two or more positive sizes, got {text!r}", hint="e.g. --prompt-tokens 64,512,2048")
    return sizes


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate_cmd(
        endpoint: Annotated[str, typer.Option("--endpoint", help="Base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000.")],
        model: Annotated[str, typer.Option("--model", help="The served model's shape: catalogue id, config.json or model directory.")],
        hardware: Annotated[str, typer.Option("--hardware", help="The card it runs on: catalogue id, probe report or hardware profile JSON.")],
        weights: Annotated[Optional[str], typer.Option("--weights", help="The served weight format (see `plan --help`; default: the model's, bf16 for a config.json).")] = None,
        api_key_file: Annotated[Optional[Path], typer.Option("--api-key-file", help="File holding the server's API key (mode 600; default: no key).")] = None,
        prompt_tokens: Annotated[str, typer.Option("--prompt-tokens", help="Prompt sizes in tokens, comma-separated; sizes past the server's max_model_len are replaced by its limit.")] = "64,1024,4096",
        short: Annotated[int, typer.Option("--short", help="Tokens of the short generation (its time is subtracted).")] = 16,
        long: Annotated[int, typer.Option("--long", help="Tokens of the long generation.")] = 144,
        repeats: Annotated[int, typer.Option("--repeats", help="Requests of each length per prompt size (the fastest is used).")] = 3,
        profile_id: Annotated[str, typer.Option("--id", help="The profile's id.")] = "served-measured",
        json_out: JsonOpt = False,
        out: OutOpt = None,
    ) -> None:
        """One stream's served decode at several contexts -> an EngineProfile for `plan --engine FILE`."""
        output.check_out(out)
        if repeats < 1:
            raise BadInput(f"--repeats must be at least 1, got {repeats}", hint="e.g. --repeats 3")
        sizes = _sizes(prompt_tokens)
        m, _ = plan_inputs.load_model(model, weights, None)
        hw = load_hardware(hardware, 1)
        client = Client(endpoint, read_api_key(api_key_file) if api_key_file else None)
        try:
            doc, rows = endpoint_profile.calibrate(client, m, hw, sizes, short, long, repeats, profile_id)
        finally:
            client.close()
        output.write_json(out, doc)
        table = output.table(
            f"served vs planned decode, {doc['measurement']['served_model']} at {endpoint} on {hw.card.id}",
            [("context", "right"), "role", ("served tok/s", "right"), ("planned tok/s", "right"), ("error", "right")],
            [[str(r["context_tokens"]), r["role"], f"{r['served_tok_s']:.2f}",
              "—" if r["predicted_tok_s"] is None else f"{r['predicted_tok_s']:.2f}",
              "—" if r["error"] is None else f"{r['error']:+.1%}"] for r in rows],
            caption="planned: `v100plan plan --engine PROFILE` on the same model and card; fitted points set the profile, "
                    "held-out ones test it" + (f"; profile written to {out}" if out else ""))
        if json_out:
            output.render(table, to_stderr=True)
            output.emit_json({**doc, "side_by_side": rows})
        else:
            output.render(table, to_stderr=False)
