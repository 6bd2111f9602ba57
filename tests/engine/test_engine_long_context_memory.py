"""engine.bench.long_context records the cards' used memory itself (MemorySampler: nvidia-smi polled in a thread
while the service runs), so a 256K run's peak can be set beside the planner's memory. Checked here with stand-in
commands for nvidia-smi: real processes printing what nvidia-smi prints, and one that fails."""

from __future__ import annotations

import sys
import time

from engine.bench.long_context import MemorySampler, _gpu_indices


def _fake(lines: str, code: int = 0) -> list[str]:
    return [sys.executable, "-c", f"import sys; print({lines!r}); sys.exit({code})"]


def test_the_peak_is_the_largest_sum_over_the_run_s_cards():
    with MemorySampler([0, 0], interval_s=0.05, command=_fake("0, 1200\n1, 99999")) as m:
        time.sleep(0.3)
    r = m.result()
    assert r["max"] == 1200 and r["samples"] >= 2 and r["gpus"] == [0]  # two ranks on one card: the card once
    with MemorySampler([0, 1], interval_s=0.05, command=_fake("0, 1200\n1, 800")) as m:
        time.sleep(0.2)
    assert m.result()["max"] == 2000


def test_no_nvidia_smi_or_a_failing_one_gives_the_reason_not_a_number():
    with MemorySampler([0], interval_s=0.05, command=["/nonexistent/nvidia-smi"]) as m:
        pass
    r = m.result()
    assert r["max"] is None and r["samples"] == 0 and "FileNotFoundError" in r["reason"]
    with MemorySampler([0], interval_s=0.05, command=_fake("NVIDIA-SMI has failed", 9)) as m:
        pass
    assert m.result()["max"] is None and "exited 9" in m.result()["reason"]


def test_the_cards_come_from_the_devices_argument():
    assert _gpu_indices("cuda:0,cuda:0") == [0, 0]
    assert _gpu_indices("cuda:1,cuda:3") == [1, 3]
    assert _gpu_indices("cpu") == []
