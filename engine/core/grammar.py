"""Constrained decoding: a grammar's token mask applied to each step's logits, with xgrammar.

xgrammar (the library vLLM and SGLang use; it runs on CPU) compiles a JSON schema against the model's
vocabulary once per (model, schema) and then, per token, fills a bitmask of the tokens the grammar
allows next; masked logits are -inf, so greedy and sampled choices stay inside the grammar. Chosen
over llguidance for being the one both big servers default to, with a plain CPU Python API
(``GrammarMatcher.fill_next_token_bitmask`` + ``apply_token_bitmask_inplace``) that needs no GPU.

Both ranks build the same matcher from the same spec and feed it the same tokens, so their masks and
choices are identical (the lockstep hash checks the tokens). The spec travels in the generate message:

  {"kind": "json_object"}                        any JSON object
  {"kind": "json_schema", "schema": "<JSON text>"}  JSON valid against the schema (strict: no extra keys
                                                  unless the schema allows them)

JSON is compact (no free whitespace between tokens, as vLLM's xgrammar default): a model may otherwise
pad an answer with whitespace until max_tokens. The end-of-sequence token is allowed only once the
value is complete. ``python -m engine.core.grammar --bench`` prints the per-token mask cost.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path


class GrammarError(ValueError):
    """A spec xgrammar cannot compile (the message names why)."""


def check_spec(spec: dict) -> None:
    """GrammarError unless ``spec`` compiles (without a vocabulary: the proxy checks before sending)."""
    import xgrammar as xgr

    try:
        if spec.get("kind") == "json_schema":
            xgr.Grammar.from_json_schema(spec["schema"], any_whitespace=False, strict_mode=True)
        elif spec.get("kind") != "json_object":
            raise GrammarError(f"unknown grammar kind {spec.get('kind')!r}")
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / InvalidJSONError for a bad schema
        raise GrammarError(f"the JSON schema cannot be enforced: {str(exc).splitlines()[0][:300]}") from None


@functools.lru_cache(maxsize=4)
def compiler_for(model_dir: str):
    """A GrammarCompiler over the model's vocabulary (tokenizer.json; the model's vocab_size, padded rows too)."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    from engine.core.config import files_dir

    files = files_dir(model_dir)
    config = json.loads((Path(files) / "config.json").read_text())
    config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    eos = config.get("eos_token_id")
    eos_ids = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else None)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(files) / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=int(config["vocab_size"]), stop_token_ids=eos_ids)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
    compiler.vocab_size = info.vocab_size  # the mask's width (xgrammar's compiler does not expose its info)
    return compiler


def _compile(compiler, spec: dict):
    try:
        if spec.get("kind") == "json_schema":
            return compiler.compile_json_schema(spec["schema"], any_whitespace=False, strict_mode=True)
        if spec.get("kind") == "json_object":
            return compiler.compile_builtin_json_grammar()
    except Exception as exc:  # noqa: BLE001 - see check_spec
        raise GrammarError(f"the JSON schema cannot be enforced: {str(exc).splitlines()[0][:300]}") from None
    raise GrammarError(f"unknown grammar kind {spec.get('kind')!r}")


class Constraint:
    """One request's grammar state: mask(logits) before each choice, accept(token) after it
    (engine.core.sampling.Sampler calls both)."""

    def __init__(self, compiler, spec: dict):
        import xgrammar as xgr

        self._xgr = xgr
        compiled = _compile(compiler, spec)
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab = compiler.vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, self.vocab)

    def mask(self, logits):
        """logits [V] float32 CPU -> the same with every token the grammar forbids at -inf."""
        if self.matcher.is_terminated():
            return logits  # the value is complete and the end token was taken: nothing follows
        self.matcher.fill_next_token_bitmask(self.bitmask)
        out = logits.clone()
        view = out[: self.vocab].unsqueeze(0)                       # [1, V]
        self._xgr.apply_token_bitmask_inplace(view, self.bitmask)
        if out.numel() > self.vocab:
            out[self.vocab:] = float("-inf")                       # padded rows are never tokens
        return out

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.accept_token(int(token))


def synthetic_model(vocab: int, out: str) -> str:
    """A directory with a byte-level tokenizer.json of ``vocab`` entries (the 256 byte symbols, then random
    ASCII words) and a config.json: the mask's cost at a real model's vocabulary size, with no download."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    rng = random.Random(0)
    words = list(ByteLevel.alphabet())
    seen = set(words)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789\u0120_{}\":,[]"
    while len(words) < vocab:
        w = "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    tok = Tokenizer(models.BPE(vocab={w: i for i, w in enumerate(words)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    Path(out).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(out) / "tokenizer.json"))
    (Path(out) / "config.json").write_text(json.dumps({"vocab_size": vocab, "eos_token_id": vocab - 1}))
    return out


def bench(model_dir: str, tokens: int = 200) -> dict:
    """Per-token cost of the mask on this CPU: fill the bitmask, apply it, accept the token."""
    import time

    import torch

    spec = {"kind": "json_schema", "schema": json.dumps({
        "type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                                         "n": {"type": "integer"}}, "required": ["name", "tags", "n"]})}
    compiler = compiler_for(model_dir)
    t0 = time.perf_counter()
    constraint = Constraint(compiler, spec)
    compile_ms = (time.perf_counter() - t0) * 1e3
    gen = torch.Generator().manual_seed(0)
    vocab = constraint.vocab
    times, n = [], 0
    while n < tokens and not constraint.matcher.is_terminated():
        logits = torch.randn(vocab, generator=gen)
        t0 = time.perf_counter()
        masked = constraint.mask(logits)
        tok = int(torch.argmax(masked))
        constraint.accept(tok)
        times.append((time.perf_counter() - t0) * 1e3)
        n += 1
    times.sort()
    return {"model": model_dir, "vocab": vocab, "tokens": n, "compile_ms": round(compile_ms, 2),
            "mask_ms_median": round(times[len(times) // 2], 4) if times else None,
            "mask_ms_p90": round(times[int(len(times) * 0.9)], 4) if times else None}


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m engine.core.grammar", description="the grammar mask's per-token cost")
    p.add_argument("--bench", metavar="MODEL_DIR", help="a model directory with tokenizer.json")
    p.add_argument("--vocab", type=int, default=None,
                   help="instead: a synthetic byte-level vocabulary of this size (Qwen3.5: 248320, Llama 3: 128256)")
    p.add_argument("--tokens", type=int, default=200)
    a = p.parse_args()
    if (a.bench is None) == (a.vocab is None):
        p.error("give --bench MODEL_DIR or --vocab N")
    if a.vocab is not None:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            print(json.dumps({**bench(synthetic_model(a.vocab, d), a.tokens), "model": f"synthetic vocab {a.vocab}"}))
    else:
        print(json.dumps(bench(a.bench, a.tokens)))
