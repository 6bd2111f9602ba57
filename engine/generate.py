"""`python -m engine generate`: one-shot generation, a stable contract for users and checks.

The last line of stdout (with --json) is {"token_ids": [...], "text": "..."}:
the generated ids only, exactly --max-tokens of them unless --stop-at-eos;
--prompt-ids are used verbatim, --prompt gets the model's BOS rule; text is null
when the model directory has no tokenizer.json. --tp 2 starts two rank processes
(an unsharded checkpoint is sliced by each rank at load) and prints rank 0's result.
Exit codes: 0 done, 1 the ranks failed (start-up or mid-request), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys


def _default_dtype(device: str) -> str:
    if not device.startswith("cuda"):
        return "float32"
    import torch

    major, _ = torch.cuda.get_device_capability(torch.device(device))
    return "bfloat16" if major >= 8 else "float16"  # no bf16 tensor cores before compute capability 8.0


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=1, choices=(1, 2))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-at-eos", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]; with --tp 2, one GPU per rank if there are two")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"))
    p.add_argument("--allreduce", default="auto", choices=("auto", "gloo", "nccl", "host_mailbox", "device_mailbox"))
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    except RanksFailed as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1


class RanksFailed(RuntimeError):
    """The two ranks did not start or did not finish the request (their stderr says why)."""


def run(args: argparse.Namespace) -> int:
    from engine import config
    from engine.tokenizer import Tokenizer

    cfg = config.load(args.model)
    tok = Tokenizer.from_dir(args.model)
    if args.prompt is not None:
        if tok is None:
            raise ValueError(f"{args.model} has no tokenizer.json: give --prompt-ids instead of --prompt")
        ids = tok.encode(args.prompt)
    else:
        ids = _parse_ids(args.prompt_ids)
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ValueError(f"prompt ids {bad[:5]} are outside the vocabulary [0, {cfg.vocab_size})")
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    max_context = args.max_context or len(ids) + args.max_tokens + 1
    if len(ids) + args.max_tokens > max_context:
        raise ValueError(f"prompt ({len(ids)}) + max tokens ({args.max_tokens}) exceed --max-context {max_context}")
    stop = set(cfg.eos_token_ids) if args.stop_at_eos else set()
    dtype = args.dtype or _default_dtype(args.device)
    if args.tp == 1:
        out = _tp1(args, cfg, ids, stop, dtype, max_context)
    else:
        out = _tp2(args, ids, stop, dtype, max_context)
    text = tok.decode(out) if tok is not None else None
    if args.json:
        print(json.dumps({"token_ids": out, "text": text}))
    else:
        print(text if text is not None else " ".join(map(str, out)))
    return 0


def _tp1(args, cfg, ids, stop, dtype, max_context) -> list[int]:
    import torch

    from engine import runner, weights
    from engine.model import Model
    from engine.sampling import Sampler

    model = Model(cfg, dtype=getattr(torch, dtype), device=args.device)
    weights.load_into(model, args.model)
    model.setup_cache(max_context)
    out, _ = runner.run(model, ids, args.max_tokens, Sampler(args.temperature, args.top_p, args.seed), stop, 256)
    return out


def _tp2(args, ids, stop, dtype, max_context) -> list[int]:
    from engine import protocol
    from engine.launcher import LaunchError, RankPair

    devices = [args.device, args.device]
    if args.device.startswith("cuda"):
        import torch

        n = torch.cuda.device_count()
        devices = ["cuda:0", "cuda:1"] if n >= 2 and args.device == "cuda" else [args.device if ":" in args.device
                                                                                 else "cuda:0"] * 2
    try:
        pair = RankPair(args.model, devices, dtype, args.allreduce, max_context)
    except LaunchError as e:
        raise RanksFailed(f"the ranks did not start: {e}") from None
    try:
        print(f"ranks ready: allreduce {pair.ready[0]['allreduce']}", file=sys.stderr)
        tokens, _ = pair.generate(protocol.generate("g1", ids, args.max_tokens, args.temperature, args.top_p,
                                                    args.seed, sorted(stop)))
    except LaunchError as e:
        raise RanksFailed(f"generation failed: {e}") from None
    finally:
        pair.close()
    if tokens[0] != tokens[1]:
        raise RanksFailed("the two ranks produced different tokens (lockstep should have stopped them)")
    return tokens[0]
