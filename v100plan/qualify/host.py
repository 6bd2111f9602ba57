"""`qualify --host H`: qualify's phases against a host over SSH.

probe H (`python -m probes --quick` there) -> plan for the measured cards (waived on a CPU host)
-> deploy the engine there with fault injection, under qualify's OWN deployment (default
`qualify`; a deployment that `v100plan deploy` made is refused, so a production service is never
touched) -> accept it through an SSH port forward (faults through its control, rank logs read
over SFTP and copied next to the report) -> stop that deployment, whatever happened before
(a failed acceptance, an error, Ctrl-C). The reports are written here, as for a local run.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from v100plan.errors import BadInput, EnvironmentProblem, V100planError
from v100plan.qualify.phases import DEMO_ID, Phases

HEALTH_TIMEOUT_S = 180.0
PURPOSE = "qualify"  # what the deployment's history records; `deploy` and `stop` check it


class HostRun:
    mode = "host"
    probe_fatal = True  # no probe, no settings to deploy with: an unreachable host ends the run here
    start_name = "deploy"
    demo_id = DEMO_ID  # deploy serves it without speculation

    def __init__(self, target, port: int, device: str):  # noqa: ANN001 - v100plan.remote.supervisor.Target
        self.target = target
        self.label = self.where = target.spec.label
        self.port, self.device = port, device
        self.secrets: list[str] = []
        self.endpoint = "not started"
        self.deployed = False
        self.svc = None
        self._stack = contextlib.ExitStack()
        self.inputs: dict[str, Any] = {"host": self.label, "deployment": target.deployment, "port": port}
        self.probe_what = f"measuring {self.label}'s cards over SSH (python -m probes --quick there)"
        self.start_what = (f"deploying the engine to {self.label} as deployment {target.deployment!r} with fault "
                           "injection on (qualify's own deployment, stopped at the end)")

    def probe(self) -> dict:
        from v100plan.remote.probe import probe_host

        return probe_host(self.target.spec, self.target.ssh, self.target.remote, ["--quick"])

    def demo_model(self, out_dir: Path) -> Path:
        from v100plan.demo_model import demo_model_dir
        from v100plan.qualify.phases import DEMO_ARCH

        return demo_model_dir(DEMO_ARCH)

    def settings(self, probe: dict | None, plan: dict | None):  # noqa: ANN201 - (EngineSettings, why)
        """The engine settings for the host: the plan's tp2 launch where there is one, else the probe's
        choice, else (--device cpu, or no two cards) both ranks on the host's CPU."""
        from v100plan.remote import release as rel

        settings = chose = None
        if self.device != "cpu" and plan and plan.get("launch"):
            try:
                settings, chose = rel.settings_from_plan(plan, "qualify's plan", self.port, True)
            except BadInput as e:
                chose = f"not the plan's launch ({e.message}); "
        if settings is None and self.device != "cpu":
            settings, why = rel.settings_from_probe(probe or {"cards": []}, self.label, self.port, True, None)
            chose = (chose or "") + why
        if self.device == "cuda" and (settings is None or settings.device != "cuda"):
            raise EnvironmentProblem(f"--device cuda: the probe of {self.label} found fewer than two NVIDIA cards",
                                     hint="qualify the host on its CPU with --device auto or --device cpu")
        if settings is None:
            settings = rel.EngineSettings(device="cpu", allreduce="gloo", port=self.port, fault_injection=True,
                                          chosen_by="--device cpu")
            chose = "--device cpu: both ranks on the host's CPU (float32, gloo)"
        # qualify accepts the engine as it serves by default: as many requests at once as the cards hold (serve's
        # memory rule; 1 on CPU, with MTP or images), not the one request its plan priced
        if settings.max_concurrency is not None:
            settings = replace(settings, max_concurrency=None)
            chose += "; requests at once: the engine's default (what fits the cards; /health says it)"
        return settings, chose  # the watchdog limits deploy deploys: serve's defaults

    def start(self, model_dir: Path, probe: dict | None, plan: dict | None, notes: list[str], say):  # noqa: ANN001, ANN201
        """Deploy and reach the service; returns (the acceptance suite's Target, launch settings, a detail)."""
        from v100plan.remote import deploy as dp
        from v100plan.remote.service import host_target, open_service

        settings, chose = self.settings(probe, plan)
        say(f"chose: {chose}")
        dep = self.target.deployment
        notes.append(f"qualify deployed the engine to {self.label} as its own deployment {dep!r} (stopped at the "
                     f"end; a production deployment is never used); chose: {chose}")
        self.deployed = True  # from here on finish() stops it (stop() itself refuses a production deployment)
        out = dp.deploy(self.target, model_dir, settings, health_timeout_s=HEALTH_TIMEOUT_S, say=say, chose=chose,
                        purpose=PURPOSE)
        rs = self.target.remote
        self.svc = svc = self._stack.enter_context(open_service(self.target.spec, rs.root, dep, ssh=self.target.ssh,
                                                                python=rs.python))
        self.secrets.append(svc.api_key)
        self.endpoint = svc.endpoint
        # the suite's TP1 references run on this machine's CPU: exact only for a CPU deployment
        local_weights = model_dir if settings.device == "cpu" else None
        if local_weights is None:
            notes.append("the host's GPUs serve; reference answers are the service's own first answers (this "
                         "machine's CPU cannot reproduce a GPU's tokens exactly)")
        target = host_target(svc, dep, None, local_weights, notes)
        detail = (f"release {out.release} on {self.label} (127.0.0.1:{self.port} there, {settings.device}), "
                  f"{out.uploaded_bytes} bytes uploaded; reached at {svc.endpoint}")
        return target, svc.engine, detail

    def finish(self, out_dir: Path, phases: Phases) -> None:
        """Copy the service's logs next to the report, close the forward, stop the deployment."""
        from v100plan.remote import deploy as dp

        if self.svc is not None:
            with contextlib.suppress(OSError, V100planError):
                self.svc.copy_logs(out_dir / "logs")
        with contextlib.suppress(Exception):
            self._stack.close()
        if not self.deployed:
            return
        dep = self.target.deployment
        phases.start("stop", f"stopping deployment {dep!r} on {self.label}")
        try:
            out = dp.stop(self.target, purpose=PURPOSE)
        except V100planError as e:
            phases.end("error", f"{e.message} (stop it by hand: v100plan stop {self.label} --deployment {dep})")
            return
        except KeyboardInterrupt:
            phases.end("interrupted", f"Ctrl-C while stopping: v100plan stop {self.label} --deployment {dep}")
            return
        stopped = out.extra.get("stopped") or {}
        phases.end("passed", f"release {out.release}: " + (", ".join(f"{k} {v}" for k, v in stopped.items())
                                                            or out.reason or "nothing was running"))
