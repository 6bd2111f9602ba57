"""Counters the service exposes on /metrics, in the Prometheus text format (version 0.0.4).

Written by hand rather than with a client library: a dozen series do not justify a
dependency on every GPU host.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

_HELP = {
    "v100plan_requests_total": ("counter", "HTTP requests answered, by endpoint and status code"),
    "v100plan_prompt_tokens_total": ("counter", "prompt tokens sent to the ranks"),
    "v100plan_completion_tokens_total": ("counter", "generated tokens served to clients (rank 0's, after lockstep)"),
    "v100plan_lockstep_failures_total": ("counter", "LOCKSTEP FAILURE reports from either rank"),
    "v100plan_rank_failures_total": ("counter", "rank generations ended by the watchdog, by cause"),
    "v100plan_rank_restarts_total": ("counter", "rank pair starts after the first, successful or not"),
    "v100plan_rank_restart_failures_total": ("counter", "rank pair starts that did not come up"),
    "v100plan_cancelled_total": ("counter", "requests cancelled on both ranks (client gone or stop string)"),
    "v100plan_request_errors_total": ("counter", "requests the ranks answered with an error (the ranks stayed up)"),
    "v100plan_spec_draft_tokens_total": ("counter", "MTP draft tokens proposed (--speculative mtp; rank 0's count)"),
    "v100plan_spec_accepted_tokens_total": ("counter", "MTP draft tokens the model's verification accepted"),
    "v100plan_ranks_up": ("gauge", "1 when both ranks are up and their self-test passed"),
    "v100plan_rank_generation": ("gauge", "generation number of the current rank pair"),
    "v100plan_queue_depth": ("gauge", "requests waiting behind the running one"),
    "v100plan_requests_running": ("gauge", "requests the ranks are working on (0 or 1: one sequence at a time)"),
    "v100plan_allreduce_path": ("gauge", "1 for the allreduce path the ranks negotiated"),
    # Reported by the ranks (engine/service/proxy_decode.py); absent until a rank has reported them.
    "v100plan_decode_mode": ("gauge", "1 for how each rank runs the decode step (graphs or eager; compiled or eager kernels)"),
    "v100plan_decode_ms_per_token": ("gauge", "each rank's median wall ms per generated token (recent tokens)"),
    "v100plan_decode_step_ms": ("gauge", "each rank's median device ms per decode step (CUDA graph replays only)"),
    "v100plan_decode_achieved_gbps": ("gauge", "each rank's weight bytes per step over its step (or token) time, GB/s"),
    "v100plan_decode_read_bw_gbps": ("gauge", "each rank's card read bandwidth, GB/s (source: measured at start or flag)"),
    "v100plan_decode_read_bw_fraction": ("gauge", "achieved GB/s over the card's read bandwidth"),
}
# Series that exist only once measured: no 0 placeholder before that.
_NO_PLACEHOLDER = ("_path", "_mode", "_ms_per_token", "_step_ms", "_gbps", "_fraction")


def escape_label(value: str) -> str:
    """The text format's label-value escaping: backslash, double quote and line feed."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in labels) + "}"


@dataclass
class Metrics:
    values: dict[str, dict[tuple, float]] = field(default_factory=lambda: defaultdict(dict))

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        series = self.values[name]
        series[key] = series.get(key, 0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        self.values[name][tuple(sorted(labels.items()))] = value

    def set_only(self, name: str, value: float, **labels: str) -> None:
        """Replace every series of `name` by this one (e.g. the current allreduce path)."""
        self.values[name] = {tuple(sorted(labels.items())): value}

    def get(self, name: str, **labels: str) -> float:
        return self.values.get(name, {}).get(tuple(sorted(labels.items())), 0)

    def render(self) -> str:
        out = []
        for name, (kind, text) in _HELP.items():
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")
            series = self.values.get(name) or ({(): 0} if not name.endswith(_NO_PLACEHOLDER) else {})
            for labels, value in sorted(series.items()):
                number = int(value) if float(value).is_integer() else value
                out.append(f"{name}{_labels(labels)} {number}")
        return "\n".join(out) + "\n"
