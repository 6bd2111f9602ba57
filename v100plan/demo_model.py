"""The generated demo model on this machine, made once (`python -m engine make-demo-model`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from v100plan.errors import EnvironmentProblem


def demo_model_dir(arch: str = "llama") -> Path:
    """The demo model of ``arch`` (llama: v100plan-demo; qwen3_5: v100plan-demo-hybrid), made here once
    (byte-identical everywhere) in the local v100plan home, which must be the user's own (split.home:
    a folder another user made is refused, never trusted)."""
    from v100plan.remote import split, trusted

    d = split.home() / ("demo-model" if arch == "llama" else f"demo-model-{arch}")
    if d.exists():
        try:
            trusted.check_private(d, "demo model folder")
        except trusted.Untrusted as e:
            raise EnvironmentProblem(str(e), hint=f"remove it (rm -r {d}) if you did not make it") from None
    if not (d / "config.json").is_file():
        proc = subprocess.run([sys.executable, "-m", "engine", "make-demo-model", str(d), "--arch", arch],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise EnvironmentProblem(f"the demo model could not be made: {proc.stderr.strip()[-500:]}",
                                     hint="install the engine extra here: pip install -e '.[engine]'")
    return d
