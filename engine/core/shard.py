"""`python -m engine shard SRC DST --tp 2`: split a checkpoint per engine/core/tp.py's table and prove it
reassembles bit-exactly.

DST gets ``shard.json`` (what was split how, bytes per rank) and ``rank0/``,
``rank1/``, each a loadable model directory (config and tokenizer files copied).
A tied output head is written out explicitly, split by vocabulary, so each rank's
directory is complete on its own.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
          "special_tokens_map.json")


def _bits(t):
    import torch

    return t.contiguous().view(-1).view(torch.uint8)


def shard(src: str | Path, dst: str | Path, world: int, force: bool = False) -> dict:
    """Write the shards and verify them; returns the manifest. ValueError with the reason on refusal."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.core import config, tp, weights

    src, dst = Path(src), Path(dst)
    from engine.core import random_weights

    if random_weights.is_random(src):
        raise ValueError(f"{src} is a random-weights model (its weights are generated at load, for each rank's "
                         "part): serve it unsharded, there is nothing to split")
    cfg = config.load(src)
    tp.check_divisible(cfg, world)
    if cfg.quantization is not None:  # a row-parallel split must not cut a quantisation group
        from engine.core import quant, quant_load

        names = set()
        for path in weights.safetensors_files(src):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names.update(tp.canonical(n, cfg) for n in f.keys())
        quant.check_inputs(cfg.quantization, quant_load.layer_inputs(cfg, names), world)
    if dst.exists() and any(dst.iterdir()) and not force:
        raise ValueError(f"{dst} exists and is not empty (give --force to overwrite)")
    # Cloned: safetensors slices can share the mapped file's memory, which save_file refuses.
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    kinds: dict[str, str] = {}
    originals: dict[str, tuple[Path, str]] = {}
    for path in weights.safetensors_files(src):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            # shards hold the decoder's canonical names (a wrapper's model.language_model. read as model.)
            raw = {tp.canonical(n, cfg): n for n in f.keys() if not tp.IGNORED.search(n)}
            for name, stored in raw.items():
                kinds[name] = tp.kind_of(name)
                originals[name] = (path, stored)
                for r in range(world):
                    parts[r][name] = tp.take(f.get_slice(stored), kinds[name], r, world, cfg, name=name).clone()
            if "lm_head.weight" not in raw and "model.embed_tokens.weight" in raw:
                if not cfg.tie_word_embeddings:
                    raise ValueError("no lm_head.weight and the config does not tie it to the embeddings")
                kinds["lm_head.weight"] = "vocab"
                originals["lm_head.weight"] = (path, raw["model.embed_tokens.weight"])
                for r in range(world):
                    parts[r]["lm_head.weight"] = tp.take(f.get_slice(raw["model.embed_tokens.weight"]), "vocab",
                                                         r, world).clone()
    if dst.exists() and force:
        shutil.rmtree(dst)
    bytes_per_rank = []
    for r in range(world):
        d = dst / f"rank{r}"
        d.mkdir(parents=True, exist_ok=True)
        save_file(parts[r], str(d / "model.safetensors"), metadata={"format": "pt", "tp_rank": str(r),
                                                                     "tp_world": str(world)})
        _stable_header(d / "model.safetensors")
        for name in COPIED:
            if (src / name).exists():
                shutil.copy2(src / name, d / name)
        bytes_per_rank.append(sum(t.numel() * t.element_size() for t in parts[r].values()))
    del parts
    verify(dst, world, kinds, originals, cfg)
    counts: dict[str, int] = {}
    for k in kinds.values():
        counts[k] = counts.get(k, 0) + 1
    manifest = {"tp": world, "source": str(src), "tensors": dict(sorted(kinds.items())), "counts": counts,
                "bytes_per_rank": bytes_per_rank, "verified": "reassembled bit-exactly"}
    (dst / "shard.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _stable_header(path: Path) -> None:
    """Rewrite the safetensors header with its keys sorted: save_file writes the metadata in a hash
    map's order, which changes from run to run, and the same split must give the same bytes (a
    deployment's release id is made of the shards' SHA-256)."""
    import struct

    with open(path, "r+b") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        fh.seek(8)
        fh.write(text + b" " * (n - len(text)))  # the same compact JSON, reordered: never longer


def verify(dst: Path, world: int, kinds: dict[str, str], originals: dict[str, tuple[Path, str]], cfg=None) -> None:
    """Re-read every shard and compare its reassembly with the source tensor, byte for byte."""
    import torch
    from safetensors import safe_open

    from engine.core import tp

    handles = [safe_open(str(dst / f"rank{r}" / "model.safetensors"), framework="pt", device="cpu")
               for r in range(world)]
    for name, kind in kinds.items():
        path, src_name = originals[name]
        with safe_open(str(path), framework="pt", device="cpu") as f:
            full = f.get_tensor(src_name)
        pieces = [h.get_tensor(name) for h in handles]
        if tp.split_dim(kind, name) is None:
            ok = all(torch.equal(_bits(p), _bits(full)) for p in pieces)
        else:
            ok = torch.equal(_bits(tp.join(pieces, kind, cfg, name)), _bits(full))
        if not ok:
            raise RuntimeError(f"shard verification failed: {name} does not reassemble bit-exactly")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine shard", description=__doc__.splitlines()[0])
    p.add_argument("src", help="Hugging Face checkpoint directory")
    p.add_argument("dst", help="output directory")
    p.add_argument("--tp", type=int, default=2, help="number of ranks (2)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty DST")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    args = p.parse_args(argv)
    from engine.core.config import ConfigError
    from engine.core.tp import ShardError
    from engine.core.weights import WeightsError

    try:
        m = shard(args.src, args.dst, args.tp, args.force)
    except (ValueError, ConfigError, ShardError, WeightsError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(m))
        return 0
    print(f"sharded {args.src} -> {args.dst} for tp {m['tp']}: {m['verified']}")
    for kind in ("colwise", "colwise_qkv", "rowwise", "vocab", "replicated"):
        names = [n for n, k in m["tensors"].items() if k == kind]
        if names:
            print(f"  {kind:<10} {len(names):4d} tensors, e.g. {names[0]}")
    for r, b in enumerate(m["bytes_per_rank"]):
        print(f"  rank {r}: {b / 1e6:.1f} MB")
    return 0
