"""The kernel choice for a device (engine.core.decode_mode.kernel_choice fed with this device's facts): what the
loader hands the model for its prefill and what the runner's Decoder starts from."""

from __future__ import annotations

import torch

from engine.core import decode_mode
from engine.core.decode_mode import TRITON_MIN_CC, VOLTA_CC, kernel_choice


def device_kernels(dev: torch.device, requested: str | None = None) -> tuple[str, str]:
    """decode_mode.kernel_choice for this device: ``requested``, else V100PLAN_ENGINE_KERNELS, else automatic (on a
    V100 Triton is pointed at a ptxas that still targets sm_70). The prefill's choice where no Decoder set it."""
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    req = decode_mode.Request.of(kernels=requested)
    return kernel_choice(dev.type, cap, triton_ok(), req.kernels, sm70_ptxas(dev, cap))


def sm70_ptxas(dev: torch.device, cap) -> tuple[bool, str] | None:
    """On a 7.x card with Triton: point Triton at a ptxas that still targets sm_70 (engine.core.sm70.use())."""
    if dev.type == "cuda" and cap is not None and VOLTA_CC <= tuple(cap) < TRITON_MIN_CC and triton_ok():
        from engine.core import sm70

        return sm70.use()
    return None


def triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
