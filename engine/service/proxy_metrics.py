"""What the service exposes on /metrics, through prometheus_client (the serve extra installs it):
counters and gauges by the names the docs and dashboards use, and histograms of the time to the
first token and of the time between tokens.

The service speaks to one small facade (inc / set / set_only / clear / observe / get / render), so
the series are declared once, here, with their label names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import generate_latest

disable_created_metrics()  # no *_created series: the counters' start time is serve_start in the log

# name -> (kind, help, label names). Counters are declared without their _total suffix (the client adds it).
SERIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "v100plan_requests_total": ("counter", "HTTP requests answered, by endpoint and status code", ("endpoint", "status")),
    "v100plan_request_outcomes_total": ("counter", "generation requests by how they ended: length, stop, cancelled, "
                                        "unavailable (503), failed (500), queue_full (429)", ("outcome",)),
    "v100plan_prompt_tokens_total": ("counter", "prompt tokens sent to the ranks", ()),
    "v100plan_prefix_cache_hits_total": ("counter", "requests whose prompt started with what the ranks held (prefix "
                                         "reuse)", ()),
    "v100plan_prefix_cache_reused_tokens_total": ("counter", "prompt tokens not prefilled again (prefix reuse)", ()),
    "v100plan_completion_tokens_total": ("counter", "generated tokens served to clients (rank 0's, after lockstep)", ()),
    "v100plan_lockstep_failures_total": ("counter", "LOCKSTEP FAILURE reports from either rank", ()),
    "v100plan_rank_failures_total": ("counter", "rank generations ended by the watchdog, by cause", ("cause",)),
    "v100plan_rank_restarts_total": ("counter", "rank pair starts after the first, successful or not, by the cause "
                                     "of the failure before", ("cause",)),
    "v100plan_rank_restart_failures_total": ("counter", "rank pair starts that did not come up", ()),
    "v100plan_cancelled_total": ("counter", "requests cancelled on both ranks (client gone or stop string)", ()),
    "v100plan_connections_refused_total": ("counter", "connections over --max-connections, answered 503 and closed", ()),
    "v100plan_connections_evicted_total": ("counter", "idle connections without the API key closed to make room "
                                           "for a new one at --max-connections", ()),
    "v100plan_request_errors_total": ("counter", "requests the ranks answered with an error (the ranks stayed up)", ()),
    "v100plan_spec_draft_tokens_total": ("counter", "MTP draft tokens proposed (--speculative mtp; rank 0's count)", ()),
    "v100plan_spec_accepted_tokens_total": ("counter", "MTP draft tokens the model's verification accepted", ()),
    "v100plan_ranks_up": ("gauge", "1 when both ranks are up and their self-test passed", ()),
    "v100plan_rank_generation": ("gauge", "generation number of the current rank pair", ()),
    "v100plan_queue_depth": ("gauge", "requests waiting behind the running one", ()),
    "v100plan_requests_running": ("gauge", "requests the ranks are working on (up to serve --max-concurrency)", ()),
    "v100plan_allreduce_path": ("gauge", "1 for the allreduce path the ranks negotiated", ("path",)),
    # Reported by the ranks (engine/service/proxy_decode.py); absent until a rank has reported them.
    "v100plan_decode_mode": ("gauge", "1 for how each rank runs the decode step (graphs or eager; compiled or "
                             "eager kernels)", ("rank", "mode", "kernels")),
    "v100plan_decode_ms_per_token": ("gauge", "each rank's median wall ms per generated token (recent tokens)", ("rank",)),
    "v100plan_decode_step_ms": ("gauge", "each rank's median device ms per decode step (CUDA graph replays only)",
                                ("rank",)),
    "v100plan_decode_achieved_gbps": ("gauge", "each rank's weight bytes per step over its step (or token) time, GB/s",
                                      ("rank",)),
    "v100plan_decode_read_bw_gbps": ("gauge", "each rank's card read bandwidth, GB/s (source: measured at start or "
                                     "flag)", ("rank", "source")),
    "v100plan_decode_read_bw_fraction": ("gauge", "achieved GB/s over the card's read bandwidth", ("rank",)),
    "v100plan_time_to_first_token_seconds": ("histogram", "from a request's admission to its first token", ()),
    "v100plan_time_per_output_token_seconds": ("histogram", "between two consecutive tokens of one request", ()),
}
BUCKETS = {
    "v100plan_time_to_first_token_seconds": (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    "v100plan_time_per_output_token_seconds": (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
}
_KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


def _declared_name(name: str, kind: str) -> str:
    return name[:-len("_total")] if kind == "counter" and name.endswith("_total") else name


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self._series = {}
        self._children: dict[str, set[tuple[str, ...]]] = {}
        for name, (kind, text, labels) in SERIES.items():
            extra = {"buckets": BUCKETS[name]} if kind == "histogram" else {}
            self._series[name] = _KINDS[kind](_declared_name(name, kind), text, labels, registry=self.registry,
                                              **extra)
            self._children[name] = set()

    def _child(self, name: str, labels: dict[str, str]):
        metric = self._series[name]
        names = SERIES[name][2]
        if not names:
            return metric
        values = tuple(str(labels[k]) for k in names)
        self._children[name].add(values)
        return metric.labels(*values)

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        self._child(name, labels).inc(amount)

    def set(self, name: str, value: float, **labels: str) -> None:
        self._child(name, labels).set(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._child(name, labels).observe(value)

    def clear(self, name: str, **match: str) -> None:
        """Remove the series of `name` whose labels include `match` (all of them without `match`)."""
        names = SERIES[name][2]
        for values in list(self._children[name]):
            if all(values[names.index(k)] == str(v) for k, v in match.items()):
                self._series[name].remove(*values)
                self._children[name].discard(values)

    def set_only(self, name: str, value: float, **labels: str) -> None:
        """Replace every series of `name` by this one (e.g. the current allreduce path)."""
        self.clear(name)
        self.set(name, value, **labels)

    def get(self, name: str, **labels: str) -> float:
        kind, _, names = SERIES[name]
        sample = name if kind != "histogram" else name + "_count"
        value = self.registry.get_sample_value(sample, {k: str(labels[k]) for k in names if k in labels})
        return value or 0.0

    def render(self) -> str:
        return generate_latest(self.registry).decode()


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
