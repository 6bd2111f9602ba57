"""Start-up choice of the allreduce path: build candidates, self-test each bit-exactly on both ranks,
race the survivors at decode-sized messages, and let rank 0 decide (rank 1 follows).

A path that fails its self-test is never used. A path named explicitly must pass or
start-up fails with the reason. When both ranks share one GPU the race's timings say
nothing about two cards, so the choice then follows a fixed preference instead.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from engine.allreduce.base import Path, PathError
from engine.allreduce.device_mailbox import DeviceMailbox
from engine.allreduce.dist import GlooPath, NcclPath
from engine.allreduce.host_mailbox import HostMailbox
from engine.allreduce.paths import PATH_NAMES
from engine.core import timing

CPU_ORDER = ("host_mailbox", "gloo")
# Preference when timings cannot be trusted (both ranks on one GPU); otherwise the race decides.
GPU_ORDER = PATH_NAMES
GRAPH_OPS = 20  # allreduces per captured graph in the race
RACE_BYTES = {"8k": 8 * 1024, "40k": 40 * 1024}


@dataclasses.dataclass
class Choice:
    path: Path
    selftest: dict[str, str]  # path name -> "passed" or the reason it failed / was skipped
    race: dict[str, dict[str, float]] | None  # path -> {"8k_us": .., "40k_us": ..}
    race_trusted: bool
    why: str


def _agree_reason(reason: str | None) -> str | None:
    """A failure reason from whichever rank had one (control group), or None if both passed."""
    reasons: list[str | None] = [None, None]
    dist.all_gather_object(reasons, reason)
    found = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why]
    return "; ".join(found) or None


def same_device(device: torch.device) -> bool:
    """Whether both ranks run on one physical GPU (compared by UUID)."""
    if device.type != "cuda":
        return False
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    both: list[str | None] = [None, None]
    dist.all_gather_object(both, uuid)
    return both[0] == both[1]


def build(name: str, *, rank: int, device: torch.device, timeout_s: float, abort, rendezvous_dir: str,
          generation: int, store, shared_device: bool) -> Path:
    if name == "gloo":
        return GlooPath(rank, timeout_s, abort)
    if name == "host_mailbox":
        return HostMailbox(rank, timeout_s, abort, rendezvous_dir=rendezvous_dir, generation=generation,
                           barrier=dist.barrier)
    if name == "device_mailbox":
        return DeviceMailbox(rank, timeout_s, abort, device=device, store=store, generation=generation,
                             barrier=dist.barrier)
    if name == "device_mailbox_graph":
        if shared_device:
            raise PathError("not applicable: both ranks are on one GPU, where a kernel waiting for the other "
                            "process's kernel only progresses by time-slicing")
        from engine.allreduce.graph_mailbox import GraphMailbox

        return GraphMailbox(rank, timeout_s, abort, device=device, store=store, generation=generation,
                            barrier=dist.barrier)
    if name == "nccl":
        if shared_device:
            raise PathError("not applicable: both ranks are on one GPU and NCCL refuses duplicate devices")
        return NcclPath(rank, timeout_s, abort, device=device)
    raise PathError(f"unknown allreduce path {name!r}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def selftest(path: Path, rank: int, device: torch.device, dtype: torch.dtype, force_fail: bool = False) -> str | None:
    """Known data through allreduce_sum and gather_last, compared bit for bit; None if it passed.

    Every collective runs on both ranks whatever an earlier check found (a failed check is noted,
    not returned early): a rank that left while its peer still waited in the next collective would
    cost that peer the whole allreduce timeout. The caller then agrees on the verdict."""
    failures: list[str] = []
    for label, nbytes in RACE_BYTES.items():
        n = nbytes // torch.tensor([], dtype=dtype).element_size()
        # Both sides of the comparison round the same float32 values to dtype the same way.
        base = (torch.arange(n, dtype=torch.float32) % 251) * 0.25
        mine = (base + 1000.0 * rank).to(dtype).to(device)
        expect = ((base + 0.0).to(dtype) + (base + 1000.0).to(dtype)).to(device)  # rank 0's + rank 1's
        got = path.allreduce_sum(mine)
        if force_fail:
            got = got + 1
        if not torch.equal(_bits(got), _bits(expect)):
            failures.append(f"allreduce_sum of {label} known data is not bit-exact")
        cat = path.gather_last(mine.view(1, -1))
        expect_cat = torch.cat(((base + 0.0).to(dtype), (base + 1000.0).to(dtype))).to(device).view(1, -1)
        if not torch.equal(_bits(cat), _bits(expect_cat)):
            failures.append(f"gather of {label} known data is not bit-exact")
        if device.type == "cuda" and path.capturable:
            # The way the decode step runs it: captured in a CUDA graph, result read after a replay.
            out = {}
            g = timing.capture(lambda: out.__setitem__("y", path.allreduce_sum(mine)), device, warmup=1)
            g.replay()
            torch.cuda.synchronize(device)
            if hasattr(path, "check"):
                path.check()
            if not torch.equal(_bits(out["y"]), _bits(expect)):
                failures.append(f"allreduce_sum of {label} known data inside a CUDA graph is not bit-exact")
            del g
    return "; ".join(failures) or None


def race(path: Path, device: torch.device, dtype: torch.dtype, iters: int) -> dict[str, float]:
    """Median microseconds per allreduce at 8 KB and 40 KB, as the engine will run it: inside a CUDA
    graph for a path that can be captured (GRAPH_OPS allreduces per graph, device time between events,
    median of 5 batches of replays), else one synchronised eager call at a time (host wall time)."""
    out = {}
    graph = device.type == "cuda" and path.capturable
    for label, nbytes in RACE_BYTES.items():
        n = nbytes // torch.tensor([], dtype=dtype).element_size()
        x = torch.ones(n, dtype=dtype, device=device)
        if graph:
            us = timing.graph_us(lambda: path.allreduce_sum(x), device, GRAPH_OPS)
        else:
            us = timing.eager_us(lambda: path.allreduce_sum(x), device, iters, warmup=5)
        out[f"{label}_us"] = round(us, 2)
    out["mode"] = "graph" if graph else "eager"
    return out


def choose(requested: str, *, rank: int, device: torch.device, dtype: torch.dtype, timeout_s: float, abort,
           rendezvous_dir: str, generation: int, store, fail_selftest: set[str] = frozenset(),
           race_iters: int | None = None, log=print) -> Choice:
    shared = same_device(device)
    candidates = [requested] if requested != "auto" else list(GPU_ORDER if device.type == "cuda" else CPU_ORDER)
    results: dict[str, str] = {}
    passed: dict[str, Path] = {}
    for name in candidates:
        # Setting up a path can fail on one rank only: agree before using it, so no rank waits on a
        # peer that has already given up.
        path, why = None, None
        try:
            path = build(name, rank=rank, device=device, timeout_s=timeout_s, abort=abort,
                         rendezvous_dir=rendezvous_dir, generation=generation, store=store, shared_device=shared)
        except PathError as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - a path's library may fail in any way; it is then not used
            why = f"{type(e).__name__}: {e}"
        why = _agree_reason(why)
        if why is None:
            try:
                why = selftest(path, rank, device, dtype, force_fail=name in fail_selftest)
                if name in fail_selftest and why:
                    why += " (forced by fault injection)"
            except Exception as e:  # noqa: BLE001
                why = f"{type(e).__name__}: {e}"
            why = _agree_reason(why)
        results[name] = "passed" if why is None else why
        log(f"allreduce self-test {name}: {results[name]}")
        if why is None:
            passed[name] = path
        elif path is not None:
            path.close()
    if not passed:
        detail = "; ".join(f"{k}: {v}" for k, v in results.items())
        raise PathError(f"no allreduce path passed its self-test ({detail})")
    if len(passed) == 1:
        name = next(iter(passed))
        return Choice(passed[name], results, None, not shared, f"{name} is the only path that passed")
    iters = race_iters or (200 if device.type == "cuda" else 50)
    timings = {name: race(p, device, dtype, iters) for name, p in passed.items()}
    order = GPU_ORDER if device.type == "cuda" else CPU_ORDER
    if shared:
        pick = next(n for n in order if n in passed)
        why = f"both ranks share one GPU, so timings are not trusted; preference order picks {pick}"
    else:
        # Decode messages run from ~8 KB (an 8B model's hidden state in bf16) to ~40 KB (the 27B's):
        # the path with the least time over both sizes wins, so neither end is ignored.
        pick = min(passed, key=lambda n: timings[n]["8k_us"] + timings[n]["40k_us"])
        why = (f"{pick} was fastest over 8 KB + 40 KB ({timings[pick]['8k_us']} + "
               f"{timings[pick]['40k_us']} us median, {timings[pick]['mode']})")
    # Rank 0 decides; rank 1 follows whatever it says.
    decision = [pick if rank == 0 else None]
    dist.broadcast_object_list(decision, src=0)
    if rank != 0:
        why = f"rank 0 chose {decision[0]}"
    pick = decision[0]
    for name, p in passed.items():
        if name != pick:
            p.close()
    log(f"allreduce choice: {pick} ({why}); race {timings}")
    return Choice(passed[pick], results, timings, not shared, why)
