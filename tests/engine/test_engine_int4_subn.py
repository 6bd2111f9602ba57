"""The int4 GEMV's subnormal-pairs form (engine.core.gemv_int4.FORM_SUBN) as the card runs it, compiled for sm_90
(and sm_70) without a GPU, with the alignment a launch specialises: its loop makes two nibbles with one AND and
one fp16x2 multiply-add (no zero-point subtraction per nibble, fp16 subnormals kept: no .ftz), issues fewer than
two SASS instructions a nibble where the pairs form issues more than three, and with PDL asks L2 for its first
words before it waits for the row kernel. What the instruction count buys is measured on the card
(engine.bench.int4; docs/engine-speed.md)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def _compiled(subn: bool, pdl: bool = False, cc: int = 90, block_n: int = 128, warps: int = 4):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.core import gemv_int4, sm70

    if cc == 70:
        sm70.use()
    int4 = gemv_int4._kernels()[0]
    cx = sm70.with_defaults(int4, dict(
        HAS_BIAS=False, BLOCK_N=block_n if subn else 64, BLOCK_K=128, GS=128, ZOFF=1, EMU=False, SEND=False, EPW=2,
        STAGES=2, PAIRS=True, ASM=True, EVEN_N=True, EVEN_K=True, SPLIT=4, TB=32, TW=16, PDL=pdl, SUBN=subn))
    sig = sm70._signature(int4, cx, {"s_ptr": "*bf16"})
    # as a launch specialises them: 16-byte-aligned pointers and the 27B gate/up's sizes (N 34816, K 5120, 640
    # words a row, 160 a slice), multiples of 16
    aligned = [i for i, n in enumerate(int4.arg_names) if n not in cx and (sig[n].startswith("*") or n in (
        "N", "K", "KW", "KS"))]
    src = ASTSource(fn=int4, signature=sig, constexprs=cx, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps if subn else 4})


def _loop_instructions(cubin: bytes, tmp_path: Path) -> list[str]:
    """The SASS opcodes of the kernel's longest loop (a label and the branch back to it)."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        pytest.skip(f"no nvdisasm beside Triton ({nvdisasm})")
    f = tmp_path / "k.cubin"
    f.write_bytes(cubin)
    lines = subprocess.run([str(nvdisasm), "-c", str(f)], capture_output=True, text=True, check=True).stdout.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", ln))}
    best: list[str] = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            ops = [re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", x).group(1)
                   for x in lines[labels[m.group(1)]:i + 1] if re.search(r"/\*[0-9a-f]{4}\*/\s+\S", x)]
            best = max(best, ops, key=len)
    assert best, "no loop found in the SASS"
    return best


def test_the_subnormal_pairs_loop_issues_under_two_instructions_a_nibble(tmp_path):
    # one thread a row (128 rows, 4 warps): a tile of 16 words a row is 128 nibbles a thread; the pairs form's
    # thread holds 2 rows x 4 words (64 nibbles)
    subn = _loop_instructions(_compiled(True).asm["cubin"], tmp_path)
    pairs = _loop_instructions(_compiled(False).asm["cubin"], tmp_path)
    per_subn, per_pairs = len(subn) / 128, len(pairs) / 64
    assert per_subn < 2.0 < 3.0 < per_pairs, (per_subn, per_pairs)
    # per word: four ANDs (LOP3), four multiply-adds of nibble pairs and one of the zero points (HFMA2)
    assert subn.count("HFMA2") == 16 * 5 and subn.count("LOP3") >= 16 * 4
    assert "HMUL2" not in subn and "I2F" not in subn


def test_the_subnormal_pairs_ptx_keeps_fp16_subnormals_and_takes_no_zero_point_per_nibble():
    ptx = _compiled(True).asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    assert body.count("fma.rn.f16x2") >= 5 and ".ftz.f16x2" not in body and "fma.rn.ftz" not in body
    assert "sub.f16x2" not in body  # the pairs form's per-pair zero-point subtraction
    assert "and.b32" in body and "0x000F000F" in body.replace("983055", "0x000F000F")


def test_with_pdl_the_subnormal_form_prefetches_its_first_words_then_waits():
    ptx = _compiled(True, pdl=True).asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    wait = body.index("griddepcontrol.wait")
    assert body.count("griddepcontrol.wait") == 1
    assert 0 <= body.find("prefetch.global.L2") < wait  # the first tile's words asked of L2 before the wait
    assert body.find("fma.rn.f16x2") > wait and body.find("ld.global") > wait  # nothing read before it
    assert "griddepcontrol" not in _compiled(True, pdl=False).asm["ptx"]


def test_the_subnormal_pairs_form_compiles_for_the_v100():
    from engine.core import sm70

    found, why = sm70.use()
    if not found:
        pytest.skip(why)
    c = _compiled(True, cc=70)
    assert sm70.sass_arch(c.asm["cubin"]) == 70 and c.metadata.shared <= sm70.V100_SHARED_BYTES
