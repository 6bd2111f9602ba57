"""torch.distributed paths: gloo (CPU; GPU tensors go through host memory) and NCCL (GPU), each with an
explicit timeout. The gloo group doubles as the ranks' control channel at start-up."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from engine.allreduce.base import Path, PathError, PathTimeout


def init_control(rendezvous_dir: str, generation: int, rank: int, world: int, timeout_s: float):
    """The gloo process group over a FileStore in the rendezvous directory (one file per generation,
    so a restarted pair never meets a stale store). Gloo binds the loopback interface."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.makedirs(rendezvous_dir, exist_ok=True)
    store = dist.FileStore(os.path.join(rendezvous_dir, f"store-g{generation}"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return store


def close_control() -> None:
    """End the gloo group once the ranks chose a path that does not use it (a host or device mailbox):
    gloo's TCP listener on the loopback interface takes any local user's connection (gloo has no
    authentication), so it is open only while the ranks meet and choose. Both ranks pass the barrier
    first, so neither closes a connection the other still reads."""
    dist.barrier()
    dist.destroy_process_group()


def _failure(name: str, e: Exception, timeout_s: float) -> Exception:
    if "timeout" in str(e).lower() or "timed out" in str(e).lower():
        return PathTimeout(f"{name} allreduce did not complete within {timeout_s} s (peer stalled or gone): {e}")
    return PathError(f"{name} allreduce failed: {e}")


def _gather(x: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(parts, x, group=group)
    return parts[0], parts[1]


class GlooPath(Path):
    name = "gloo"

    def all_gather(self, x):
        host = x.detach().to("cpu").contiguous()
        try:
            a, b = _gather(host)
        except RuntimeError as e:
            raise _failure("gloo", e, self.timeout_s) from None
        return a.to(x.device), b.to(x.device)


class NcclPath(Path):
    name = "nccl"
    capturable = True  # NCCL kernels run inside a CUDA graph: the decode step captures them

    def __init__(self, rank, timeout_s, abort=None, device: torch.device | None = None):
        super().__init__(rank, timeout_s, abort)
        if device is None or device.type != "cuda":
            raise PathError("not applicable: NCCL needs CUDA devices")
        if not dist.is_nccl_available():
            raise PathError("not applicable: this torch has no NCCL")
        self.device = device
        self.group = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=timeout_s))

    def all_gather(self, x):
        try:
            return _gather(x.detach().contiguous(), self.group)
        except RuntimeError as e:
            raise _failure("nccl", e, self.timeout_s) from None
