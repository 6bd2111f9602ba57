"""`python -m engine generate`: one-shot generation, a stable contract for users and checks.

The last line of stdout (with --json) is {"token_ids": [...], "text": "...", "weights": {"format", "bytes", ...}}
(with --speculative mtp also "spec": {"draft_tokens": N, "accepted_tokens": M}, rank 0's count at --tp 2):
the generated ids only, exactly --max-tokens of them unless --stop-at-eos;
--prompt-ids are used verbatim, --prompt gets the model's BOS rule; text is null
when the model directory has no tokenizer.json; weights is the weight format (e.g. "bfloat16", "gptq-int4-g128
(bfloat16 dense)") and the bytes rank 0 holds for weights (packed tensors as packed). --tp 2 starts two rank processes
(an unsharded checkpoint is sliced by each rank at load) and prints rank 0's result.
The prompt plus --max-tokens must fit the model's positions (max_position_embeddings in its
config.json), as the service refuses such a request: a model run past its positions returns garbage.
Exit codes: 0 done, 1 the ranks failed (start-up or mid-request), 2 bad input, 4 the device asked for
is not there (--device cuda without a CUDA build of torch or without a GPU), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine import dtype_rule
from engine.allreduce.paths import ALLREDUCE_CHOICES
from engine.core import speculative


def _default_dtype(device: str) -> str:
    """engine.dtype_rule for the card ``device`` names."""
    if not device.startswith("cuda"):
        return dtype_rule.dtype_for(dtype_rule.CPU)
    import torch

    return dtype_rule.dtype_for(torch.cuda.get_device_capability(torch.device(device)))


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="model directory: config.json, weights, optional tokenizer.json (e.g. from make-demo-model)")
    p.add_argument("--tp", type=int, default=1, choices=(1, 2),
                   help="1: one process; 2: two rank processes, each with half the weights (default: 1)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text, encoded with the model's tokenizer.json and its BOS rule")
    src.add_argument("--prompt-ids", metavar="IDS", help="prompt as comma-separated token ids, used verbatim")
    src.add_argument("--batch", metavar="FILE",
                     help="--tp 1 only: JSON lines {\"prompt\", \"max_tokens\", \"temperature\", \"seed\"[, "
                          "\"sampling\": {top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty, "
                          "logit_bias}][, "
                          "\"draft_tokens\": K for MTP speculation]}, one "
                          "model load for all; prints one {\"token_ids\", \"text\"} line per request, in order")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image (PNG, JPEG, WebP) for a model with a vision tower, once per image-pad token of the "
                        "prompt, in order (e.g. --prompt '<|vision_start|><|image_pad|><|vision_end|>What is it?')")
    p.add_argument("--max-tokens", type=int, default=16, metavar="N",
                   help="tokens to generate; prompt + N must fit the model's positions (default: 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1.0 = off (default: 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--stop-at-eos", action="store_true", help="stop at the model's end-of-sequence ids (default: off)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda or cuda:N; with --tp 2, one GPU per rank if there are two (default: cpu)")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="default: float32 on CPU, bfloat16 on compute capability >= 8.0, else float16")
    p.add_argument("--allreduce", default="auto", choices=ALLREDUCE_CHOICES,
                   help="--tp 2 only: the ranks' allreduce path; auto = self-test and timing race (default: auto)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"),
                   help="the K/V cache: auto = the model's dtype; int8 = one scale per position and head (default: auto)")
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="KV cache positions to allocate, at most the model's (default: prompt + max tokens + 1)")
    speculative.add_arguments(p)
    p.add_argument("--json", action="store_true",
                   help='print {"token_ids": [...], "text": ..., "weights": {"format", "bytes"}} as the last line')
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as e:
        print(f"Error: {e}", file=sys.stderr)
        print("Hint: `python -m engine generate --help` lists every option with its default and limits", file=sys.stderr)
        return 2
    except DeviceMissing as e:
        print(f"Error: {e}", file=sys.stderr)
        print("Hint: run with --device cpu, or on a host whose `nvidia-smi` lists a GPU with a CUDA build of torch",
              file=sys.stderr)
        return 4
    except RanksFailed as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1


class RanksFailed(RuntimeError):
    """The two ranks did not start or did not finish the request (their stderr says why)."""


class DeviceMissing(RuntimeError):
    """The device asked for does not exist here (exit 4: the environment, not the input)."""


def check_device(device: str) -> None:
    """Refuse cpu/cuda spellings torch would reject, and a CUDA device this process cannot use."""
    if device == "cpu":
        return
    if not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    import torch

    if not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else "torch sees no CUDA GPU (driver missing or CUDA_VISIBLE_DEVICES empty)")
        raise DeviceMissing(f"--device {device}: {why} (torch {torch.__version__})")
    index = int(device[5:]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise DeviceMissing(f"--device {device}: there are {torch.cuda.device_count()} CUDA device(s)")


def context_limit(positions: int, prompt: int, max_tokens: int, max_context: int | None) -> int:
    """The KV positions to allocate; ValueError when the request cannot fit the model (as the service says)."""
    if max_context is not None and not 2 <= max_context <= positions:
        raise ValueError(f"--max-context must be between 2 and the model's {positions} positions, got {max_context}")
    limit = max_context or positions
    if prompt + max_tokens > limit:
        raise ValueError(f"prompt ({prompt}) + max tokens ({max_tokens}) = {prompt + max_tokens} exceeds the context "
                         f"limit of {limit} tokens" + ("" if max_context else " (the model's max_position_embeddings)"))
    return max_context or prompt + max_tokens + 1


def run(args: argparse.Namespace) -> int:
    from engine.core import config
    from engine.core.tokenizer import Tokenizer

    cfg = config.load(args.model)
    tok = Tokenizer.from_dir(args.model)
    if args.batch is not None:
        if args.image:
            raise ValueError("--image goes with one --prompt or --prompt-ids, not --batch")
        return _batch(args, cfg, tok)
    if args.prompt is not None:
        if tok is None:
            raise ValueError(f"{args.model} has no tokenizer.json: give --prompt-ids instead of --prompt")
        ids = tok.encode(args.prompt)
    else:
        ids = _parse_ids(args.prompt_ids)
    args.image_bytes = [open(f, "rb").read() for f in args.image]
    if args.image_bytes:
        ids = _expand(args.model, ids, args.image_bytes)
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ValueError(f"prompt ids {bad[:5]} are outside the vocabulary [0, {cfg.vocab_size})")
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    max_context = context_limit(cfg.max_position_embeddings, len(ids), args.max_tokens, args.max_context)
    check_device(args.device)
    stop = set(cfg.eos_token_ids) if args.stop_at_eos else set()
    dtype = args.dtype or _default_dtype(args.device)
    args.spec_tokens = speculative.draft_tokens(args)
    spec: dict = {}
    if args.tp == 1:
        out, held = _tp1(args, cfg, ids, stop, dtype, max_context, spec)
    else:
        out, held = _tp2(args, ids, stop, dtype, max_context, spec)
    text = tok.decode(out) if tok is not None else None
    if args.json:  # "weights": the format and the bytes rank 0 holds (packed tensors for GPTQ / AWQ)
        extra = {"spec": {k: spec[k] for k in ("draft_tokens", "accepted_tokens")}} if args.spec_tokens else {}
        print(json.dumps({"token_ids": out, "text": text, "weights": held, **extra}))
    else:
        print(text if text is not None else " ".join(map(str, out)))
    return 0


def _expand(model_dir: str, ids: list[int], data: list[bytes]) -> list[int]:
    """The prompt's image-pad tokens expanded to each image's token count (engine.vision.serve)."""
    from engine.vision import config as vconfig
    from engine.vision import serve as vserve

    vcfg = vconfig.load(model_dir)
    if vcfg is None:
        raise ValueError(f"{model_dir} has no vision_config in config.json: --image needs a model with a vision tower")
    return vserve.expand_prompt(ids, data, vcfg, vconfig.image_rules(model_dir, vcfg))


def _tp1(args, cfg, ids, stop, dtype, max_context, spec: dict) -> tuple[list[int], dict]:
    import torch

    from engine.core import runner, weights
    from engine.core.model import Model
    from engine.core.sampling import Sampler

    model = Model(cfg, dtype=getattr(torch, dtype), device=args.device, kv_dtype=args.kv_cache_dtype)
    weights.load_into(model, args.model)
    model.setup_cache(max_context)
    info: dict = {}
    vision, spec_tokens = None, args.spec_tokens
    if args.image_bytes:
        from engine.vision import serve as vserve
        from engine.vision.load import load_vision

        vision = load_vision(model, args.model)
        ids, spec_tokens = vserve.begin(vision, {"prompt_ids": ids, "images": vserve.wire(args.image_bytes)},
                                        spec_tokens)
    out, _ = runner.run(model, ids, args.max_tokens, Sampler(args.temperature, args.top_p, args.seed), stop, 256,
                        info=info, spec_tokens=spec_tokens)
    spec.update(info.get("spec") or {})
    return out, model.weights_info()


def _batch(args, cfg, tok) -> int:
    """Many TP1 requests on one loaded model (the acceptance suite's reference answers)."""
    import torch

    from engine.core import runner, weights
    from engine.core.logits_processors import Processing
    from engine.core.model import Model
    from engine.core.sampling import Sampler

    if args.tp != 1:
        raise ValueError("--batch runs TP1 only; leave out --tp 2")
    if tok is None:
        raise ValueError(f"{args.model} has no tokenizer.json: --batch takes text prompts")
    try:
        with open(args.batch) as fh:
            requests = [json.loads(line) for line in fh if line.strip()]
    except json.JSONDecodeError as e:
        raise ValueError(f"--batch {args.batch}: line is not JSON ({e.msg})") from None
    check_device(args.device)
    dtype = args.dtype or _default_dtype(args.device)
    model = Model(cfg, dtype=getattr(torch, dtype), device=args.device, kv_dtype=args.kv_cache_dtype)
    weights.load_into(model, args.model)
    stop = set(cfg.eos_token_ids) if args.stop_at_eos else set()
    jobs = [(tok.encode(str(req["prompt"])), int(req.get("max_tokens", args.max_tokens)), req) for req in requests]
    # One cache for the whole batch, as a rank keeps one for all its requests: on a GPU the decode step's
    # graphs are captured once over it, so a later, longer request must fit the first one's cache.
    limits = [context_limit(cfg.max_position_embeddings, len(ids), n, args.max_context) for ids, n, _ in jobs]
    model.setup_cache(max(limits, default=2))
    for ids, n, req in jobs:
        # "sampling": top_k, min_p, penalties, logit_bias [[id, bias]] as the service's generate message carries them
        sampler = Sampler(float(req.get("temperature") or 0.0), float(req.get("top_p", 1.0)), int(req.get("seed") or 0),
                          processing=Processing.from_message(req.get("sampling"), ids))
        # "draft_tokens" K: this request decodes speculatively with the model's MTP layer (a served --speculative
        # mtp service's sampled answers follow the rejection rule's draws, so its reference must too)
        out, _ = runner.run(model, ids, n, sampler, stop, 256, spec_tokens=int(req.get("draft_tokens") or 0))
        print(json.dumps({"token_ids": out, "text": tok.decode(out)}), flush=True)
    return 0


def _tp2(args, ids, stop, dtype, max_context, spec: dict) -> tuple[list[int], dict | None]:
    from engine.service import protocol
    from engine.service.launcher import LaunchError, RankPair

    devices = [args.device, args.device]
    if args.device.startswith("cuda"):
        import torch

        n = torch.cuda.device_count()
        devices = ["cuda:0", "cuda:1"] if n >= 2 and args.device == "cuda" else [args.device if ":" in args.device
                                                                                 else "cuda:0"] * 2
    try:
        pair = RankPair(args.model, devices, dtype, args.allreduce, max_context, kv_cache_dtype=args.kv_cache_dtype,
                        draft_tokens=args.spec_tokens)
    except LaunchError as e:
        raise RanksFailed(f"the ranks did not start: {e}") from None
    try:
        print(f"ranks ready: allreduce {pair.ready[0]['allreduce']} (self-test {pair.ready[0]['allreduce']}: "
              f"{pair.ready[0].get('selftest')})", file=sys.stderr)
        choice = pair.ready[0].get("choice")
        if choice:  # why this path, and what became of the others (skipped with the reason, failed, passed)
            tested = "; ".join(f"{k}: {v}" for k, v in choice["selftest"].items())
            print(f"allreduce choice: {choice['why']} (self-tests: {tested})", file=sys.stderr)
        if pair.ready[0].get("decode"):  # how rank 0 decodes and why (its log line, from its ready message)
            from engine.core.runner import describe

            print(f"rank 0: {describe(pair.ready[0]['decode'])}", file=sys.stderr)
        from engine.vision.serve import wire

        tokens, done = pair.generate(protocol.generate("g1", ids, args.max_tokens, args.temperature, args.top_p,
                                                    args.seed, sorted(stop), images=wire(args.image_bytes)))
    except LaunchError as e:
        raise RanksFailed(f"generation failed: {e}") from None
    finally:
        pair.close()
    spec.update((done[0].get("decode") or {}).get("spec") or {})
    if tokens[0] != tokens[1]:
        raise RanksFailed("the two ranks produced different tokens (lockstep should have stopped them)")
    return tokens[0], (pair.ready[0].get("decode") or {}).get("weights")
