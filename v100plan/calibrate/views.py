"""What a bench ran, in catalogue terms: the model whose shape it decoded, the card it ran on, and the
pair as the planner sees it (from the probe report when given, else that catalogued card x 2)."""

from __future__ import annotations

from typing import Any

from v100plan import catalogue
from v100plan.calibrate.fit import BenchProblem
from v100plan.cards import by_device_name, identify
from v100plan.planner import hardware_from_doc
from v100plan.planner.from_probe import hardware_from_probe

MODEL_FOR_CONFIG = {"llama-3.1-8b.config.json": "llama3.1-8b-fp16"}


def model_id_for(bench: dict[str, Any]) -> str | None:
    """The catalogue model whose shape the bench ran (None when layers were cut or the config is unknown)."""
    if bench.get("layers_override"):
        return None
    return MODEL_FOR_CONFIG.get(bench.get("config", ""))


def card_id_for(bench: dict[str, Any], probe: dict[str, Any] | None = None) -> str | None:
    """The catalogued card the bench ran on: the probe report's card 0 when given (PCI ids), else the bench's
    recorded CUDA device name; None when neither names exactly one catalogued card."""
    hardware = catalogue.all_of("hardware")
    if probe and probe.get("cards"):
        found, _ = identify(probe["cards"][0], hardware)
        if found:
            return found["id"]
    device = ((bench.get("cards") or [{}])[0] or {}).get("device") or ""
    found = by_device_name(device, hardware)
    return found["id"] if found else None


def hardware(probe: dict[str, Any] | None, probe_source: str | None, card_id: str | None = None):
    """The pair as the planner sees it: from the probe report when given, else the catalogue card ``card_id`` x 2."""
    if probe:
        return hardware_from_probe(probe, catalogue.all_of("hardware"), probe_source or "probe report", 2)
    if card_id is None:
        raise BenchProblem("no probe report and no catalogued card for this bench: give --probe or --hardware")
    return hardware_from_doc(catalogue.get("hardware", card_id), 2)
