"""The V100 path (compute capability 7.0, fp16): a ptxas that still targets sm_70, and every Triton kernel of the
fused decode step compiled for it, which needs no GPU.

CUDA 13 no longer targets sm_70; CUDA 12's ptxas does (the pip wheel nvidia-cuda-nvcc-cu12 carries one in
nvidia/cuda_nvcc/bin/ptxas; Triton's own bundled ptxas is a CUDA 12.9 one up to at least Triton 3.9). ``ptxas()``
finds one that really turns sm_70 PTX into a cubin; ``use()`` points Triton at it (TRITON_PTXAS_PATH). On sm_70
Triton's NVIDIA backend makes FMA code instead of MMA for tl.dot (no mma.m16n8k16 on Volta), which the batch-1
GEMVs never use and the one-query attention uses on [16, 128]-sized tiles.

``python -m engine.core.sm70`` compiles every kernel the V100 runs (kernel choice "fused": the dense GEMVs and
their prologues and exchange, the one-query attention and its combine, the int4 GEMV, its batched form for 2..16
rows and the prefill dequantise, the Gated DeltaNet decode and prefill kernels, the speculative verification's
rows norm; the in-graph lockstep's kernels run from 8.0 only) for sm_70 in fp16 and prints, per kernel, the
cubin's size, as JSON (tests/engine/test_engine_sm70.py runs it in CI).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from engine import tuning

PTXAS_ENV = "TRITON_PTXAS_PATH"
VOLTA = (7, 0)
V100_SHARED_BYTES = 96 * 1024  # shared memory a V100 block may use (opt-in above 48 KB): a kernel asking more fails
_PTX = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry v100plan_probe() { ret; }\n"


def _candidates() -> list[tuple[str, str]]:
    out = []
    if os.environ.get(PTXAS_ENV):
        out.append((os.environ[PTXAS_ENV], PTXAS_ENV))
    for base in sys.path:
        p = Path(base) / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
        if p.exists():
            out.append((str(p), "the nvidia-cuda-nvcc-cu12 wheel"))
            break
    try:
        import triton

        p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        if p.exists():
            out.append((str(p), f"Triton {triton.__version__}'s bundled ptxas"))
    except ImportError:
        pass
    return out


def _version(path: str) -> str | None:
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", text)
    return m.group(1) if m else None


@functools.cache
def ptxas() -> tuple[str | None, str]:
    """(path of a ptxas that compiles sm_70, why) or (None, why not): each candidate is asked to compile a
    one-instruction sm_70 kernel."""
    tried = []
    for path, source in _candidates():
        version = _version(path)
        with tempfile.TemporaryDirectory() as d:
            src, out = Path(d) / "probe.ptx", Path(d) / "probe.cubin"
            src.write_text(_PTX)
            try:
                ok = subprocess.run([path, "-arch=sm_70", str(src), "-o", str(out)], capture_output=True,
                                    timeout=60).returncode == 0 and out.exists()
            except (OSError, subprocess.SubprocessError):
                ok = False
        if ok:
            return path, f"ptxas {version} ({source}) compiles sm_70"
        tried.append(f"{source}: ptxas {version or 'unknown version'} does not compile sm_70")
    if not tried:
        return None, "no ptxas found (pip install nvidia-cuda-nvcc-cu12, or set TRITON_PTXAS_PATH)"
    return None, "; ".join(tried) + " (CUDA 13 dropped sm_70: pip install nvidia-cuda-nvcc-cu12)"


def use() -> tuple[bool, str]:
    """Point Triton at an sm_70 ptxas (TRITON_PTXAS_PATH) if one is found: (found, why)."""
    path, why = ptxas()
    if path is not None:
        os.environ[PTXAS_ENV] = path
    return path is not None, why


# ---- the kernels the V100 runs, with the constexpr variants the fused decode step launches --------------------
_FLOATS = ("eps", "scale")
_I64 = ("xs_peer", "xs_inbox", "xs_ser", "xs_ready", "pos_ptr", "xs_timeout")
_I32 = ("xs_failed", "count_ptr", "qw_ptr", "qz_ptr", "perm_ptr")
_F32 = ("part_acc", "part_ml", "part_ptr", "hp_ptr", "hw_ptr")


def _signature(fn, constexprs: dict, types: dict | None = None) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if types and name in types:
            sig[name] = types[name]
        elif name in constexprs:
            sig[name] = "constexpr"
        elif name in _FLOATS:
            sig[name] = "fp32"
        elif name in ("xs_timeout",):
            sig[name] = "i64"
        elif name in _I64:
            sig[name] = "*i64"
        elif name in _I32:
            sig[name] = "*i32"
        elif name in _F32:
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*fp16"
        else:
            sig[name] = "i32"
    return sig


def variants() -> list[tuple[str, object, dict, int]]:
    """(label, triton kernel, constexprs, num_warps[, argument types]) of every kernel the fused decode step runs,
    fp16: the dense models' and the hybrid's (27B shape: gated attention of head dim 256 with a quarter rotary and
    zero-centred norms, the Gated DeltaNet decode kernel and its prefill kernels), the int8 K/V cache's attention."""
    from engine.kernels import (
        attention_jit,
        decode,
        exchange_jit,
        gdn_chunk_jit,
        gdn_decode_jit,
        gemv_int4_jit,
        gemv_int4_rows_jit,
        gemv_jit,
        rows_norm_jit,
    )

    pro, finish = gemv_jit.gemv_prologue_kernel, exchange_jit.exchange_finish_kernel
    attn, comb = attention_jit.attention_kernel, attention_jit.combine_kernel
    int4, deq, int4_row = gemv_int4_jit.int4_gemv_kernel, gemv_int4_jit.dequant_kernel, gemv_int4_jit.int4_row_kernel
    silu16 = tuning.load(VOLTA).fp16_silu
    prep, chunk = gdn_chunk_jit.gdn_chunk_prep_kernel, gdn_chunk_jit.gdn_chunk_kernel
    base = dict(HAS_BIAS=False, BLOCK_N=8, BLOCK_K=512, EVEN_K=True, EMU=False, STATS_BLOCK=4096, SEND=False,
                EPW=2)
    q4 = dict(HAS_BIAS=False, BLOCK_N=32, BLOCK_K=128, GS=128, ZOFF=1, EMU=False, SEND=False, EPW=2, STAGES=2,
              PAIRS=False, ASM=True, EVEN_N=False, EVEN_K=True, SPLIT=1, TB=0, TW=16)
    q4row = dict(HAS_PERM=False, SUB=128, EMU=False, STATS_BLOCK=8192, PAIRS=False)
    rows4 = gemv_int4_rows_jit.int4_rows_kernel  # the batched GEMV (continuous batching's 2..16 rows), words in tiles
    q4rows = dict(HAS_BIAS=False, HAS_PERM=False, M_PAD=16, BLOCK_N=64, BLOCK_K=128, GS=128, ZOFF=1, DOT=False,
                  DOT_F32=False, EMU=False, SPLIT=1, EVEN_K=True, EVEN_N=True, TB=32, TW=16)
    attn_c = dict(N_HEADS=32, N_KV=8, G=4, G_PAD=16, HD=128, CHUNK=128, BLOCK_S=128, SPLITS=8, QK_NORM=True,
                  DOT_F32=False, ONE_KERNEL=True, EMU=False)
    return [
        ("gemv_prologue:norm", pro, {**base, "PROLOGUE": 1}, 4),
        ("gemv_prologue:silu+send", pro, {**base, "PROLOGUE": 2, "SEND": True}, 4),
        ("gemv_prologue:silu, fp16 blocks (the V100's tuning table's fp16_silu)", pro,
         {**base, "PROLOGUE": 2, "BLOCK_N": silu16[0], "BLOCK_K": silu16[1]}, silu16[2]),
        ("gemv_prologue:plain+send", pro, {**base, "PROLOGUE": 0, "SEND": True}, 4),
        ("exchange_finish:norm", finish, dict(BLOCK=4096, EPW=2, EMU=False, INTERP=False, BUMP=True, NORM=True), 8),
        ("exchange_finish:sum", finish, dict(BLOCK=512, EPW=2, EMU=False, INTERP=False, BUMP=False, NORM=False), 4),
        ("attention", attn, attn_c, 8),
        ("attention:combine", comb, dict(SPLITS=8, G=4, G_PAD=16, HD=128, EMU=False), 4),
        ("attention:27b gated, rotary 64, zero-centred (tiles of decode.VOLTA_TILE / 256 positions)", attn,
         {**attn_c, "N_HEADS": 24, "N_KV": 4, "G": 6, "HD": 256, "ROT": 64, "GATED": True, "ZC": True,
          "BLOCK_S": decode.VOLTA_TILE // 256, "CHUNK": decode.VOLTA_TILE // 256}, 8),
        ("attention:int8 K/V", attn, {**attn_c, "INT8": True}, 8,
         {"kc_ptr": "*i8", "vc_ptr": "*i8", "ksc_ptr": "*fp32", "vsc_ptr": "*fp32"}),
        ("attention:int8 K/V, own position apart, fp16 by byte permute", attn,
         {**attn_c, "INT8": True, "APART": True, "PERMUTE": True}, 8,
         {"kc_ptr": "*i8", "vc_ptr": "*i8", "ksc_ptr": "*fp32", "vsc_ptr": "*fp32"}),
        ("attention:own position apart", attn, {**attn_c, "APART": True}, 8),
        ("attention:the batched step's rows, 27b gated, int8 K/V", attn,
         {**attn_c, "N_HEADS": 24, "N_KV": 4, "G": 6, "HD": 256, "ROT": 64, "GATED": True, "ZC": True, "INT8": True,
          "BLOCK_S": decode.VOLTA_TILE // 256, "CHUNK": decode.VOLTA_TILE // 256, "ROWS": True}, 8,
         {"kc_ptr": "*i8", "vc_ptr": "*i8", "ksc_ptr": "*fp32", "vsc_ptr": "*fp32", "slot_ptr": "*i64"}),
        ("attention:combine gated", comb, dict(SPLITS=8, G=6, G_PAD=16, HD=256, EMU=False, GATED=True), 4),
        ("gdn_decode:27b", gdn_decode_jit.gdn_decode_kernel, dict(NK=16, NV=48, DK=128, DV=128, KSIZE=4, EMU=False), 8,
         {"state_ptr": "*fp32", "pos_ptr": "*i64"}),
        ("gdn_decode:27b, the batched step's rows", gdn_decode_jit.gdn_decode_kernel,
         dict(NK=16, NV=48, DK=128, DV=128, KSIZE=4, EMU=False, ROWS=True), 8,
         {"state_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64"}),
        ("gdn_chunk:27b prefill", chunk, dict(DK=128, DV=128, BV=32, C=64, IEEE=False, EMU=False), 4,
         {"last_ptr": "*fp32", "state_ptr": "*fp32", "out_ptr": "*fp32"}),
        ("gdn_chunk:27b prefill parts", prep, dict(NV=48, RATIO=3, DK=128, DV=128, C=64, IEEE=False, EMU=False), 4,
         {"g_ptr": "*fp32", "beta_ptr": "*fp32", "last_ptr": "*fp32", "scr_ptr": "*fp32"}),
        ("gemv_prologue:norm zero-centred", pro, {**base, "PROLOGUE": 1, "ZC": True}, 4),
        ("int4_row:norm zero-centred", int4_row, {**q4row, "PROLOGUE": 1, "ZC": True}, 4),
        ("int4_row:norm", int4_row, {**q4row, "PROLOGUE": 1}, 4),
        ("int4_row:silu", int4_row, {**q4row, "PROLOGUE": 2}, 4),
        ("int4_row:plain, desc_act order", int4_row, {**q4row, "PROLOGUE": 0, "HAS_PERM": True, "SUB": 32}, 4),
        ("int4_row:norm, fp16 pairs", int4_row, {**q4row, "PROLOGUE": 1, "PAIRS": True}, 4),
        ("int4_gemv", int4, q4, 1),
        ("int4_gemv:fp16 pairs (inline PTX)", int4, {**q4, "PAIRS": True}, 1),
        ("int4_gemv:fp16 pairs, split-K", int4, {**q4, "PAIRS": True, "SPLIT": 8, "BLOCK_N": 64}, 2),
        ("int4_gemv:send", int4, {**q4, "SEND": True}, 1),
        ("int4_gemv:split-K", int4, {**q4, "SPLIT": 8}, 1),
        ("int4_gemv:group 32", int4, {**q4, "GS": 32, "BLOCK_K": 32}, 1),
        ("int4_gemv:128 x 256 tiles, no prefetch", int4, {**q4, "BLOCK_N": 128, "BLOCK_K": 256, "STAGES": 1,
                                                           "SPLIT": 8}, 4),
        ("int4_gemv:fp16 pairs, words held in tiles", int4, {**q4, "PAIRS": True, "SPLIT": 8, "TB": 32, "TW": 16}, 1),
        ("int4_gemv:words held in tiles, no prefetch", int4, {**q4, "STAGES": 1, "TB": 32, "TW": 16}, 1),
        ("int4_dequant", deq, dict(GS=128, ZOFF=1, BLOCK_N=32, BLOCK_K=128, TB=0, TW=16), 4),
        ("rows_norm:add + norm, zero-centred (the speculative verification's rows)", rows_norm_jit.add_norm_kernel,
         dict(EMU=False, ZC=True, DELTA=True, BLOCK=8192), 8),
        ("rows_norm:q/k heads' norm", rows_norm_jit.add_norm_kernel, dict(EMU=False, ZC=False, DELTA=False, BLOCK=128),
         4),
        ("int4_dequant:words held in tiles", deq, dict(GS=128, ZOFF=1, BLOCK_N=32, BLOCK_K=128, TB=32, TW=16), 4),
        ("int4_rows:FMA form, 2 rows, bias", rows4, {**q4rows, "M_PAD": 2, "BLOCK_N": 64, "HAS_BIAS": True}, 4),
        ("int4_rows:FMA form, 16 rows, split-K, desc_act order", rows4,
         {**q4rows, "M_PAD": 16, "BLOCK_N": 8, "SPLIT": 8, "HAS_PERM": True, "EVEN_N": False}, 4),
        ("int4_rows:DOT form, 16 rows (FMA code on sm_70), split-K", rows4, {**q4rows, "DOT": True, "SPLIT": 8}, 4),
        ("int4_rows:FMA form, 4 rows, the next tile loaded ahead", rows4,
         {**q4rows, "M_PAD": 4, "BLOCK_N": 32, "STAGES": 2}, 4),
    ]


def with_defaults(fn, constexprs: dict) -> dict:
    """The constexprs a launch gives a kernel: those named, and the defaults of the constexpr parameters not named
    (a launch specialises them; left out of an ASTSource they would be compiled as runtime i32 arguments, and
    every branch on them compiled in)."""
    import inspect

    out = {p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    out.update(constexprs)
    return out


def sass_arch(cubin: bytes) -> int | None:
    """The SM a cubin's machine code is for (its ELF header's e_flags, low byte, for the CUDA ELF ABI up to 7), or
    None when it is not a CUDA ELF."""
    import struct

    if len(cubin) < 52 or cubin[:4] != b"\x7fELF" or cubin[7] != 0x33:  # ELFOSABI_CUDA
        return None
    return struct.unpack_from("<I", cubin, 48)[0] & 0xFF


def compile_all(capability: tuple[int, int] = (7, 0)) -> dict:
    """Compile every variant for the capability (no GPU needed): per kernel its cubin's bytes and target."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    found, why = use()
    cc = capability[0] * 10 + capability[1]
    results = []
    for label, kern, constexprs, warps, *types in variants():
        constexprs = with_defaults(kern, constexprs)
        src = ASTSource(fn=kern, signature=_signature(kern, constexprs, types[0] if types else None),
                        constexprs=constexprs)
        try:
            c = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps})
            targets = re.findall(r"\.target\s+(sm_\w+)", c.asm["ptx"])
            results.append({"kernel": label, "cubin_bytes": len(c.asm["cubin"]), "sass_arch": sass_arch(c.asm["cubin"]),
                            "ptx_target": targets[0] if targets else None, "num_warps": warps,
                            "shared_bytes": c.metadata.shared, "error": None})
        except Exception as e:  # noqa: BLE001 - one kernel's failure is reported, the others still compile
            results.append({"kernel": label, "cubin_bytes": None, "sass_arch": None, "ptx_target": None,
                            "num_warps": warps, "shared_bytes": None,
                            "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"})
    return {"target": f"sm_{cc}", "dtype": "float16", "triton": triton.__version__, "ptxas": why,
            "ptxas_found": found, "kernels": results,
            "shared_limit_bytes": V100_SHARED_BYTES,
            "all_compiled": all(r["error"] is None and r["sass_arch"] == cc and r["shared_bytes"] <= V100_SHARED_BYTES
                                for r in results)}


def main(argv: list[str] | None = None) -> int:
    out = compile_all()
    print(json.dumps(out, indent=1))
    return 0 if out["all_compiled"] else 1


if __name__ == "__main__":
    sys.exit(main())
