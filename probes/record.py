"""Record fixtures on a GPU host: the ProbeReport and every raw NVML answer behind it.

``python -m probes.record DIR --name h200 [probe options...]`` writes
DIR/<name>-probe-<mode>.json (the report, raw samples included) and
DIR/<name>-nvml-answers.json (each distinct NVML query with its answer or error, replayable
through probes/replay.py so CI runs the real inventory code on real answers).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from probes import nvml

SCRUBBED = ("nvmlDeviceGetSerial", "nvmlDeviceGetUUID")


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--name":
        print(__doc__, file=sys.stderr)
        return 2
    out_dir, name, probe_argv = Path(argv[0]), argv[2], argv[3:]
    out_dir.mkdir(parents=True, exist_ok=True)
    answers = nvml.start_recording()
    from probes.__main__ import main as probe_main

    mode = "quick" if "--quick" in probe_argv else "soak" if "--soak" in probe_argv else "standard"
    report_path = out_dir / f"{name}-probe-{mode}.json"
    code = probe_main([*probe_argv, "--out", str(report_path)])
    seen, distinct = set(), []
    for entry in answers:
        key = (entry["name"], json.dumps(entry["args"]))
        if key not in seen:  # the sampler asks the same questions many times: keep the first answer
            seen.add(key)
            if entry["name"] in SCRUBBED and "value" in entry:
                entry = {**entry, "value": "scrubbed-by-recorder"}  # fixtures get shared: no serials
            distinct.append(entry)
    (out_dir / f"{name}-nvml-answers.json").write_text(json.dumps(
        {"recorded_with": "python -m probes.record " + " ".join(argv[1:]), "constants": nvml.constants_used,
         "nvml_answers": distinct}, indent=1) + "\n")
    print(f"wrote {report_path} and {name}-nvml-answers.json ({len(distinct)} NVML answers); probe exit {code}",
          file=sys.stderr)
    return code


if __name__ == "__main__":
    import os

    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
