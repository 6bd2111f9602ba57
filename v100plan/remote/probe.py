"""`v100plan probe --host`: run `python -m probes` on hosts over SSH and bring the ProbeReports back.

One host: a warm host (bundle and venv already there) costs one SSH command; a cold one
gets the bundle uploaded and a venv built first. A fleet runs one thread per host (up
to 32 at once); a host that fails is recorded with its error and never stops the others.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from v100plan import documents
from v100plan.errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, V100planError
from v100plan.remote import bundle as bundle_mod
from v100plan.remote import venv as venv_mod
from v100plan.remote.connect import Remote, SshOptions
from v100plan.remote.errors import RemoteFailed
from v100plan.remote.host import RemoteSettings, prepare, sh_path
from v100plan.remote.hosts import HostSpec

MISSING = 97  # the warm-path command's "bundle or venv not there yet"
MAX_PARALLEL = 32


class NotPrepared(RemoteFailed):
    """A read-only probe found no bundle or venv on the host (making them would change the host)."""


@dataclass
class HostResult:
    host: str
    report: dict[str, Any] | None = None
    error: str | None = None
    hint: str | None = None
    exit_code: int = 0            # the error's exit code (0 when the report came back)
    wall_s: float = 0.0
    started_s: float = 0.0        # time.monotonic() when this host's work began and ended
    ended_s: float = 0.0
    uploaded_bytes: int = 0
    stages: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "ok": self.report is not None, "error": self.error, "hint": self.hint,
                "exit_code": self.exit_code, "wall_s": round(self.wall_s, 3), "uploaded_bytes": self.uploaded_bytes,
                "report": self.report}


def _probe_command(bundle_dir: str, venv_dir: str, args: list[str]) -> list[str]:
    script = (f"test -f {sh_path(venv_dir)}/.v100plan-complete && test -d {sh_path(bundle_dir)}/probes "
              f"|| exit {MISSING}; cd {sh_path(bundle_dir)} && exec {sh_path(venv_dir)}/bin/python -m probes "
              + shlex.join(["--progress", *args]))
    return ["sh", "-c", script]


def probe_host(spec: HostSpec, ssh: SshOptions, settings: RemoteSettings, args: list[str],
               stage: Callable[[str], None] = lambda s: None,
               bundle: bundle_mod.Bundle | None = None, read_only: bool = False,
               sent: list[int] | None = None) -> dict[str, Any]:
    """The host's validated ProbeReport (raises a V100planError when it cannot be had). ``read_only``:
    never upload or build anything (NotPrepared when the host lacks the bundle or the venv). ``sent``
    gets the bytes uploaded (the bundle, when the host lacked it), however the probe ends."""
    b = bundle or bundle_mod.build()
    reqs = venv_mod.probe_requirements()
    vid = venv_mod.venv_id(settings.python, reqs, settings.index_url, settings.site_packages)
    with Remote(spec, ssh) as remote:
        try:
            return _probe(remote, spec, settings, args, stage, b, reqs, vid, read_only)
        finally:
            if sent is not None:
                sent.append(remote.bytes_sent)


def _probe(remote: Remote, spec: HostSpec, settings: RemoteSettings, args: list[str],
           stage: Callable[[str], None], b: bundle_mod.Bundle, reqs: list[str], vid: str,
           read_only: bool) -> dict[str, Any]:
    stage("connected")
    cmd = _probe_command(f"{settings.root}/bundles/{b.id}", f"{settings.root}/venvs/{vid}", args)
    r = remote.run(cmd, what="python -m probes", check=False)
    if r.exit_code == MISSING and read_only:
        raise NotPrepared(f"{spec.label}: the probes bundle or its venv is not on the host yet",
                          hint="run `v100plan probe --host` once (it uploads the bundle and builds the venv)")
    if r.exit_code == MISSING:
        prepare(remote, settings, reqs, stage=stage, bundle=b)
        stage("probing")
        r = remote.run(cmd, what="python -m probes", check=False)
    stage("reading the report")
    if r.exit_code == 2:
        raise RemoteFailed(f"{spec.label}: python -m probes rejected its options: {r.stderr.strip()[-500:]}",
                           hint="`python -m probes --list` shows the case keys")
    if r.exit_code not in (0, 1, 3):
        raise RemoteFailed(f"{spec.label}: python -m probes exited with {r.exit_code}: "
                           f"{r.stderr.strip()[-800:]}", hint="run `python -m probes` on the host to see why")
    try:
        doc = json.loads(r.stdout)
    except json.JSONDecodeError as e:
        raise RemoteFailed(f"{spec.label}: python -m probes printed no report ({e.msg})",
                           hint="run `python -m probes` on the host to see its output") from None
    report = documents.validate(doc, "probe_report", source=f"{spec.label}: python -m probes")
    report.setdefault("provenance", {})
    return report


def probe_fleet(specs: list[HostSpec], ssh: SshOptions, settings: RemoteSettings, args: list[str],
                on_stage: Callable[[str, str], None] = lambda h, s: None) -> list[HostResult]:
    """Probe every host in parallel; results in the order given, each with its report or its error."""
    b = bundle_mod.build()

    def one(spec: HostSpec) -> HostResult:
        res = HostResult(host=spec.label, started_s=time.monotonic())
        sent: list[int] = []

        def stage(text: str) -> None:
            res.stages.append(text)
            on_stage(spec.label, text)

        try:
            stage("connecting")
            res.report = probe_host(spec, ssh, settings, args, stage, bundle=b, sent=sent)
            stage("done")
        except V100planError as e:
            res.error, res.hint, res.exit_code = e.message, e.hint, e.exit_code
            stage(f"failed: {e.message}")
        except Exception as e:  # noqa: BLE001 - one host's surprise never stops the others
            res.error, res.exit_code = f"{type(e).__name__}: {e}", EXIT_ENVIRONMENT
            stage(f"failed: {res.error}")
        res.uploaded_bytes = sum(sent)
        res.ended_s = time.monotonic()
        res.wall_s = res.ended_s - res.started_s
        return res

    if len(specs) == 1:
        return [one(specs[0])]
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(specs)), thread_name_prefix="probe") as pool:
        return list(pool.map(one, specs))


def worst_exit(results: list[HostResult]) -> int:
    codes = [r.exit_code for r in results if r.exit_code]
    if EXIT_BAD_INPUT in codes:
        return EXIT_BAD_INPUT
    return max(codes, default=0)
