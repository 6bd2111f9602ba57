"""NVML clock-event ("throttle") reason bits and their names.

The bit values are NVML's nvmlClocksEventReason* constants (nvml.h); by hand:
``nvidia-smi -q -d PERFORMANCE`` lists the same reasons as Active / Not Active.
"""

from __future__ import annotations

REASON_BITS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,  # thermal or power brake, raised by the board
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}
THERMAL = ("sw_thermal_slowdown", "hw_thermal_slowdown")
POWER = ("sw_power_cap", "hw_power_brake_slowdown")


def decode(mask: int | None) -> list[str]:
    """0x24 -> ["sw_power_cap", "sw_thermal_slowdown"]; unknown bits appear as "bit_0x..."."""
    if mask is None:
        return []
    names = [name for name, bit in REASON_BITS.items() if mask & bit]
    known = 0
    for bit in REASON_BITS.values():
        known |= bit
    rest = mask & ~known
    names += [f"bit_{1 << i:#x}" for i in range(64) if rest & (1 << i)]
    return names
