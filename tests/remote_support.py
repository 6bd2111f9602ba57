"""Recordings combined for the remote tests' torch-coverage cases."""

from __future__ import annotations

import json

from tests.conftest import FIXTURES


def v100_pair_with_h200_torch() -> tuple[dict, dict]:
    """The field recording's V100 pair (compute capability 7.0) with the torch build measured on the lent
    H200 (2.11.0+cu130, arch list from sm_75), each card's coverage judged by the probe's own rule; and the H200 recording itself."""
    from probes import fatbin

    v100 = json.loads((FIXTURES / "probes" / "facts-sxm2-pair-nvlink-hot-card1.json").read_text())
    h200 = json.loads((FIXTURES / "probes" / "h200-probe-quick.json").read_text())
    for k in ("torch_version", "torch_cuda_version", "torch_arch_list"):
        v100["host"][k] = h200["host"][k]
    for card in v100["cards"]:
        card["torch_supported"], _ = fatbin.covers(v100["host"]["torch_arch_list"], card["compute_capability"])
    return v100, h200
