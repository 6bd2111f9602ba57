"""The generated demo model on this machine, made once (`python -m engine make-demo-model`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from v100plan.errors import EnvironmentProblem


def demo_model_dir(arch: str = "llama") -> Path:
    """The demo model of ``arch`` (llama: v100plan-demo; qwen3_5: v100plan-demo-hybrid), made here once
    (byte-identical everywhere); $V100PLAN_HOME or a per-user temp dir."""
    base = Path(os.environ.get("V100PLAN_HOME") or Path(tempfile.gettempdir()) / f"v100plan-{os.getuid()}")
    d = base / ("demo-model" if arch == "llama" else f"demo-model-{arch}")
    if not (d / "config.json").is_file():
        d.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "engine", "make-demo-model", str(d), "--arch", arch],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise EnvironmentProblem(f"the demo model could not be made: {proc.stderr.strip()[-500:]}",
                                     hint="install the engine extra here: pip install -e '.[engine]'")
    return d
