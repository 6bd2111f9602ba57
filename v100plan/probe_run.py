"""Running ``python -m probes`` as a process and reading its ProbeReport.

Here, on this machine (the probes run where the cards are); on another host v100plan/remote/probe.py
runs the same module over SSH and reads the same JSON. Progress events arrive as JSON lines on the
child's stderr.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from v100plan import documents
from v100plan.errors import BadInput, EnvironmentProblem


def probe_args(quick: bool, soak: float | None, duration: float | None, only: str | None) -> list[str]:
    args = []
    if quick:
        args.append("--quick")
    if soak is not None:
        args += ["--soak", str(soak)]
    if duration is not None:
        args += ["--duration", str(duration)]
    if only:
        args += ["--only", only]
    return args


def _bundle_root() -> str:
    spec = importlib.util.find_spec("probes")
    if spec is None or not spec.origin:
        raise EnvironmentProblem("the probes bundle is not installed next to v100plan",
                                 hint="reinstall v100plan: pip install -e '.[probes]'")
    return str(Path(spec.origin).resolve().parent.parent)


def run(args: list[str], on_event: Callable[[dict[str, Any]], None], timeout_s: float) -> dict[str, Any]:
    """Run the probes with ``args``; return the validated report dict."""
    env = dict(os.environ)
    env["PYTHONPATH"] = _bundle_root() + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = [sys.executable, "-m", "probes", "--progress", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    other_stderr: list[str] = []

    def read_events() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                other_stderr.append(line)
                continue
            if isinstance(event, dict) and "event" in event:
                on_event(event)
            else:
                other_stderr.append(line)

    chunks: list[str] = []

    def read_stdout() -> None:
        assert proc.stdout is not None
        chunks.append(proc.stdout.read())

    # Two readers of our own: communicate() would also read stderr and race the progress reader.
    reader = threading.Thread(target=read_events, daemon=True)
    out_reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    out_reader.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise EnvironmentProblem(f"the probes did not finish within {timeout_s:.0f} s",
                                 hint="run `python -m probes --progress` by hand to see which case hangs") from None
    reader.join(timeout=10)
    out_reader.join(timeout=10)
    stdout = "".join(chunks)
    if proc.returncode == 2:  # the probes rejected an option (an unknown --only key)
        raise BadInput("".join(other_stderr).strip() or "python -m probes rejected its options",
                       hint="`python -m probes --list` shows the case keys")
    if proc.returncode not in (0, 1, 3):
        tail = "".join(other_stderr)[-800:]
        raise EnvironmentProblem(f"`python -m probes` exited with {proc.returncode}: {tail.strip()}",
                                 hint="run `python -m probes` by hand to see the whole error")
    try:
        doc = json.loads(stdout)
    except json.JSONDecodeError as e:
        raise EnvironmentProblem(f"`python -m probes` printed no report ({e.msg})",
                                 hint="run `python -m probes` by hand to see its output") from None
    return documents.validate(doc, "probe_report", source="python -m probes")
