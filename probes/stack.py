"""Software stack vs the cards: can the installed NCCL, torch and cupy run on each card's
compute capability, and what to install when they cannot.

NCCL: its version (ncclGetVersion through ctypes) and the architectures its kernels
cover, read from the library file (probes/fatbin.py; cross-checked with
``cuobjdump --list-elf --list-ptx`` where that tool exists). torch: its CUDA
version and ``torch.cuda.get_arch_list()``. cupy: its CUDA runtime and NVRTC's
supported targets. Where two or more cards exist, a small NCCL allreduce through
torch.cuda.nccl proves NCCL runs.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from probes import fatbin, fatbin_cache, gpu
from probes.cases import Outcome, case, needs_cards
from probes.context import ProbeContext


def _nccl_version_of(path: str) -> str | None:
    try:
        lib = ctypes.CDLL(path)
        v = ctypes.c_int()
        if lib.ncclGetVersion(ctypes.byref(v)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    code = v.value
    # NCCL >= 2.9 encodes major*10000 + minor*100 + patch; older ones major*1000 + minor*100 + patch.
    if code >= 10000:
        return f"{code // 10000}.{(code % 10000) // 100}.{code % 100}"
    return f"{code // 1000}.{(code % 1000) // 100}.{code % 100}"


def loaded_nccl_path() -> str | None:
    """The libnccl this process has mapped (torch loads it when asked for its NCCL version)."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            if "libnccl" in line and "/" in line:
                return line[line.index("/"):].strip()
    except OSError:
        return None
    return None


def candidate_nccl_paths() -> list[str]:
    found: list[str] = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found += glob.glob(os.path.join(root, "nccl", "lib", "libnccl.so*"))
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/cuda/lib64", "/usr/lib/aarch64-linux-gnu"):
        found += glob.glob(os.path.join(d, "libnccl.so*"))
    real = []
    for p in found:
        rp = os.path.realpath(p)
        if rp not in real and os.path.isfile(rp):
            real.append(rp)
    return real


def cuobjdump_archs(path: str) -> list[str] | None:
    tool = shutil.which("cuobjdump")
    if not tool:
        return None
    names: set[str] = set()
    for flag, prefix in (("--list-elf", "sm_"), ("--list-ptx", "compute_")):
        try:
            r = subprocess.run([tool, flag, path], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
        for m in re.finditer(r"\.sm_(\d+)a?\.(?:cubin|ptx)", r.stdout):
            names.add(prefix + m.group(1))
    return sorted(names, key=lambda n: (int(re.sub(r"\D", "", n)), n))


def describe_nccl(path: str, cross_check: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"path": path, "version": _nccl_version_of(path)}
    try:
        entry["archs"], entry["archs_source"] = fatbin_cache.archs_in(path)
    except (OSError, ValueError) as e:
        entry["archs"] = None
        entry["archs_problem"] = f"cannot read the library's device code: {e}"
    if cross_check:
        entry["archs_cuobjdump"] = cuobjdump_archs(path)
    return entry


def read_stack(ctx: ProbeContext) -> dict[str, Any]:
    """Fill the host's software facts; returns the NCCL library descriptions."""
    torch = None
    try:
        torch = gpu.torch()
    except gpu.Missing as e:
        for f in ("torch_version", "torch_cuda_version", "torch_arch_list"):
            ctx.set_host(f, None, str(e))
    nccl_version = None
    if torch is not None:
        ctx.set_host("torch_version", torch.__version__)
        ctx.set_host("torch_cuda_version", torch.version.cuda, "torch has no CUDA build")
        ctx.set_host("torch_arch_list", list(torch.cuda.get_arch_list()))
        try:
            nccl_version = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception as e:  # noqa: BLE001 - a torch built without NCCL
            ctx.set_host("nccl_version", None, f"torch reports no NCCL: {e}")
    try:
        cp = gpu.cupy()
        ctx.set_host("cupy_version", cp.__version__)
        rt = cp.cuda.runtime.runtimeGetVersion()
        ctx.set_host("cupy_cuda_version", f"{rt // 1000}.{(rt % 1000) // 10}")
        try:
            ctx.set_host("nvrtc_archs", [f"sm_{a}" for a in cp.cuda.nvrtc.getSupportedArchs()])
        except Exception as e:  # noqa: BLE001 - older NVRTC has no such query
            ctx.set_host("nvrtc_archs", None, f"NVRTC cannot list its targets: {e}")
    except gpu.Missing as e:
        for f in ("cupy_version", "cupy_cuda_version", "nvrtc_archs"):
            ctx.set_host(f, None, str(e))

    paths = candidate_nccl_paths()
    used = loaded_nccl_path()
    if used and os.path.realpath(used) not in paths:
        paths.insert(0, os.path.realpath(used))
    # cuobjdump over a 300 MB library can take longer than quick mode allows: cross-check in the
    # standard and soak modes, or when asked (the recorder asks).
    cross = ctx.options.mode != "quick" or os.environ.get("V100PLAN_PROBE_CROSSCHECK") == "1"
    libs = [describe_nccl(p, cross_check=cross) for p in paths]
    ctx.host["nccl_libraries"] = libs
    chosen = None
    if used:
        chosen = next((lib for lib in libs if lib["path"] == os.path.realpath(used)), None)
    if chosen is None and nccl_version:
        chosen = next((lib for lib in libs if lib["version"] == nccl_version), None)
    if chosen is None and libs:
        chosen = libs[0]
    if chosen:
        ctx.set_host("nccl_version", nccl_version or chosen["version"], "ncclGetVersion failed")
        ctx.set_host("nccl_library", chosen["path"])
        ctx.set_host("nccl_archs", chosen["archs"], chosen.get("archs_problem"))
    else:
        why = "no libnccl found (pip nvidia-nccl-*, /usr/lib, /usr/local/cuda) and none loaded"
        ctx.set_host("nccl_version", nccl_version, why)
        ctx.set_host("nccl_library", None, why)
        ctx.set_host("nccl_archs", None, why)
    return {"libraries": libs, "torch": torch}


def judge_card(ctx: ProbeContext, cc: str) -> dict[str, Any]:
    """Per-card support booleans with the reason for each."""
    out: dict[str, Any] = {}
    archs = ctx.host.get("nccl_archs")
    if archs is not None:
        out["nccl_supported"], out["nccl_how"] = fatbin.covers(archs, cc)
    torch_archs = ctx.host.get("torch_arch_list")
    if torch_archs is not None:
        out["torch_supported"], out["torch_how"] = fatbin.covers(
            [a if a.startswith(("sm_", "compute_")) else "sm_" + a for a in torch_archs], cc)
    nvrtc = ctx.host.get("nvrtc_archs")
    if nvrtc is not None:
        want = "sm_" + cc.replace(".", "")
        out["cupy_supported"] = want in nvrtc
        out["cupy_how"] = f"NVRTC targets {want}" if out["cupy_supported"] else f"NVRTC cannot target {want}"
    return out


def small_allreduce(torch: Any, n_cards: int) -> str:
    """Sum a 40 KB tensor across every card with NCCL (torch.cuda.nccl); '' when right, else what went wrong."""
    tensors = [torch.full((10240,), float(i + 1), device=f"cuda:{i}") for i in range(n_cards)]
    torch.cuda.nccl.all_reduce(tensors)
    for i in range(n_cards):
        torch.cuda.synchronize(i)
    want = n_cards * (n_cards + 1) / 2
    bad = [i for i, t in enumerate(tensors) if not bool((t == want).all())]
    return f"allreduce gave a wrong sum on card(s) {bad}" if bad else ""


@case("software_stack", "Whether the installed NCCL, torch and cupy carry code for each card's architecture",
      order=20, timeout_s=240, applicable=needs_cards, needs=("inventory",))
def run_stack(ctx: ProbeContext) -> Outcome:
    got = read_stack(ctx)
    problems, notes, details = [], [], {}
    for card in ctx.cards:
        cc = card.values.get("compute_capability")
        if not cc:
            continue
        j = judge_card(ctx, cc)
        details[card.index] = j
        for field in ("nccl_supported", "torch_supported", "cupy_supported"):
            if field in j:
                card.set(field, j[field])
            else:
                card.set(field, None, "the library or its architecture list is not available on this host")
        if j.get("torch_supported") is False:
            problems.append(f"card {card.index} (sm_{cc.replace('.', '')}): torch {ctx.host.get('torch_version')} "
                            f"has no kernels for it ({j['torch_how']}); install a torch build whose "
                            f"torch.cuda.get_arch_list() lists sm_{cc.replace('.', '')}")
        if j.get("nccl_supported") is False:
            text = (f"card {card.index} (sm_{cc.replace('.', '')}): NCCL {ctx.host.get('nccl_version')} at "
                    f"{ctx.host.get('nccl_library')} has no kernels for it; install an NCCL whose library lists "
                    f"sm_{cc.replace('.', '')} (check with `cuobjdump --list-elf libnccl.so.2`)")
            # One card never runs NCCL collectives, so a gap there is a warning for later, not a failure now.
            (problems if len(ctx.cards) > 1 else notes).append(text)
        if j.get("cupy_supported") is False:
            notes.append(f"card {card.index}: {j['cupy_how']} (cupy kernels, including this probe's, cannot run)")
    libs = got["libraries"]
    details["nccl_libraries"] = [{k: v for k, v in lib.items() if k != "path"} | {"path": lib["path"]}
                                 for lib in libs]
    mismatch = [lib for lib in libs if lib.get("archs_cuobjdump") is not None
                and lib.get("archs") is not None and set(lib["archs_cuobjdump"]) != set(lib["archs"])]
    if mismatch:
        notes.append("the file parser and cuobjdump disagree on " + ", ".join(m["path"] for m in mismatch))
    if len(ctx.cards) > 1 and got["torch"] is not None and not problems:
        wrong = small_allreduce(got["torch"], len(ctx.cards))
        details["allreduce"] = wrong or "40 KB NCCL allreduce over all cards: right sum"
        if wrong:
            problems.append(wrong)
    verdict = "failed" if problems else ("warned" if notes else "passed")
    ctx.set_host("stack_verdict", verdict)
    ctx.set_host("stack_fix", "; ".join(problems + notes) or None, "nothing to fix")
    if problems:
        return Outcome("failed", "; ".join(problems + notes), details)
    if notes:
        return Outcome("warned", "; ".join(notes), details)
    return Outcome("passed", None, details)
