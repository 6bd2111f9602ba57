"""qualify on this machine: `python -m probes --quick` here, the engine under its supervisor here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.core.speculative import DEFAULT_DRAFT_TOKENS
from v100plan.qualify.phases import DEMO_ARCH, Phases, note_plan_allreduce

# qualify's drafts per round for a model with an MTP layer: the engine's default (the field's setting)
SPEC_DRAFTS = DEFAULT_DRAFT_TOKENS


def _devices(device: str, probe: dict | None) -> str:
    if device != "auto":
        return device
    cards = len(probe["cards"]) if probe else 0
    return "cuda" if cards >= 2 else ("cuda:0,cuda:0" if cards == 1 else "cpu")


def _dtype(devices: str, probe: dict | None, plan: dict | None, demo: bool = False) -> str:
    # The demo model is there to check answers token for token against a TP1 run, which holds only in
    # float32: in half precision TP2's split sums round differently from one card's, and the demo
    # model's random weights give near-flat logits where that flips an argmax (seen on two H200s).
    if devices == "cpu" or demo:
        return "float32"
    launch = (plan or {}).get("launch") or {}
    if launch.get("dtype") in ("float16", "bfloat16"):
        return launch["dtype"]
    # No plan: the cards decide (bf16 needs compute capability 8.0; a V100 is 7.0).
    caps = [c.get("compute_capability") for c in (probe or {}).get("cards", [])]
    return "bfloat16" if caps and all(c and float(c) >= 8.0 for c in caps) else "float16"


class LocalRun:
    """qualify on this machine: `python -m probes` here, the engine under its supervisor here."""

    mode, where = "local", "this machine"
    probe_what = "measuring this machine's cards (python -m probes --quick)"
    probe_fatal = False
    start_name, start_what = "start", "starting the bundled engine under its supervisor"
    demo_id = "v100plan-demo-hybrid-mtp"  # with its MTP draft layer: served with --speculative mtp

    def __init__(self, device: str):
        self.device = device
        self.demo = False  # set when qualify generated the demo model
        self.svc = None
        self.secrets: list[str] = []
        self.endpoint = "not started"
        self.inputs: dict[str, Any] = {}

    def probe(self) -> dict:
        from v100plan import probe_run

        return probe_run.run(probe_run.probe_args(True, None, None, None), lambda _e: None, timeout_s=900)

    def demo_model(self, out_dir: Path) -> Path:
        from v100plan.accept.local import make_demo_model

        return make_demo_model(out_dir / "demo-model-hybrid-mtp", arch=DEMO_ARCH, mtp=True)

    def start(self, model_dir: Path, probe: dict | None, plan: dict | None, notes: list[str], say):  # noqa: ANN001, ANN201
        """Start the service; returns (the acceptance suite's Target, the engine's launch settings, a detail)."""
        from v100plan.accept.context import Target
        from v100plan.accept.local import LocalService, has_mtp_layer

        devices = _devices(self.device, probe)
        dtype = _dtype(devices, probe, plan, demo=self.demo)
        note_plan_allreduce(plan, notes)
        if self.demo and devices != "cpu":
            notes.append("the demo model is served in float32 on the GPUs too, so its answers can be compared "
                         "token for token with a TP1 run; speeds are not a half-precision model's")
        if devices == "cpu":
            notes.append("no GPU: both ranks run on CPU (float32, gloo or the host mailbox); speeds are not "
                         "a GPU's and no plan applies")
        # The service's own limits, as deploy deploys them (no qualify-only watchdog flags): the report's
        # target.limits records them from its /health.
        # A model with an MTP draft layer (the demo's) is served with speculation on, so every scenario (the
        # faults and the load too) runs through speculative rounds; one service, not a second one.
        spec = ["--speculative", "mtp", "--draft-tokens", str(SPEC_DRAFTS)] if has_mtp_layer(model_dir) else []
        if spec:
            notes.append(f"served with --speculative mtp --draft-tokens {SPEC_DRAFTS} (the model's MTP draft layer): "
                         "greedy answers are checked against a TP1 run without speculation, sampled ones against a "
                         "TP1 run speculating alike")
        self.svc = svc = LocalService(model_dir, devices=devices, dtype=dtype, allreduce="auto", serve_flags=spec)
        self.secrets.append(svc.api_key)
        self.endpoint = svc.endpoint
        svc.start()
        health = svc.health()
        engine = {"tp": 2, "devices": list(("cpu", "cpu") if devices == "cpu" else
                                           (("cuda:0", "cuda:1") if devices == "cuda" else devices.split(","))),
                  "dtype": dtype, "allreduce": health.get("allreduce"), "max_context": None,
                  **({"speculative": {"method": "mtp", "draft_tokens": SPEC_DRAFTS}} if spec else {})}
        target = Target(endpoint=svc.endpoint, api_key=svc.api_key, mode="local", model_dir=str(model_dir),
                        engine=engine, supervised=True, read_rank_logs=svc.read_rank_logs,
                        read_service_log=svc.read_service_log, notes=notes)
        return target, engine, f"{svc.endpoint}, allreduce {engine['allreduce']}, devices {','.join(engine['devices'])}"

    def finish(self, out_dir: Path, phases: Phases) -> None:
        """Stop every process the service started, keep its logs next to the report."""
        if self.svc is None:
            return
        try:
            self.svc.stop()
        except Exception:  # noqa: BLE001 - stopping must not hide the run's own outcome
            pass
        self.svc.keep_logs(out_dir / "logs")
        self.svc.remove()


