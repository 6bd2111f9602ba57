"""What the ranks report about their decode step, kept for /metrics, /health and the service log.

Each rank sends how it decodes (mode, kernels and why, its card's read bandwidth and where that figure
came from) in its ``ready`` message, and its figures so far (engine.core.runner.Decoder.stats: ms per
step and per token, achieved GB/s, fraction of the read bandwidth) in every ``done``. Nothing here is
estimated: a figure the ranks have not reported yet is absent, not zero.
"""

from __future__ import annotations

import time

from engine.service.proxy_log import StructuredLog
from engine.service.proxy_metrics import Metrics

# (gauge, key in the rank's stats) with the label set {rank}
GAUGES = (("v100plan_decode_ms_per_token", "token_ms"), ("v100plan_decode_step_ms", "step_ms"),
          ("v100plan_decode_achieved_gbps", "achieved_gbps"),
          ("v100plan_decode_read_bw_fraction", "read_bw_fraction"))
LOG_EVERY_S = 60.0  # a decode_stats log line after the first request of a pair, then at most this often
FIELDS = ("mode", "why", "kernels", "kernels_why", "allreduce", "exchange", "exchange_why", "lockstep", "windows",
          "capture_s", "read_bw_gbps", "read_bw_source", "weight_bytes", "steps", "step_ms", "token_ms", "achieved_gbps", "read_bw_fraction",
          "host_ms", "weights", "speculation", "prefix_cache", "memory", "device")


class DecodeReport:
    def __init__(self, metrics: Metrics, log: StructuredLog):
        self.metrics = metrics
        self.log = log
        self.ranks: dict[int, dict] = {}
        self._logged: float | None = None

    def ranks_up(self, links) -> None:
        """A new pair is up: its ranks' ready messages say how they decode; earlier figures are gone."""
        self.ranks = {}
        self._logged = None
        for name in ("v100plan_decode_mode", "v100plan_decode_read_bw_gbps", *(g for g, _ in GAUGES)):
            self.metrics.clear(name)
        for link in links:
            info = (link.ready or {}).get("decode")
            if not isinstance(info, dict):
                continue
            self.ranks[link.rank] = {k: info.get(k) for k in FIELDS if k in info}
            self._gauges(link.rank)
        if self.ranks:
            self.log.emit("decode", ranks={r: self._brief(d, stats=False) for r, d in sorted(self.ranks.items())})

    def after_request(self, done: list) -> None:
        """Both ranks' ``done`` messages: their decode figures so far."""
        for d in done:
            stats = (d or {}).get("decode")
            if isinstance(stats, dict) and d.get("_rank") is not None:
                self.ranks[d["_rank"]] = {k: stats.get(k) for k in FIELDS if k in stats}
                self._gauges(d["_rank"])
        now = time.monotonic()
        if self.ranks and (self._logged is None or now - self._logged >= LOG_EVERY_S):
            self._logged = now
            self.log.emit("decode_stats", ranks={r: self._brief(d) for r, d in sorted(self.ranks.items())})

    def health(self) -> dict | None:
        """/health's detailed view: per rank, how it decodes and what it achieves."""
        return {str(r): dict(d) for r, d in sorted(self.ranks.items())} or None

    def speculation(self, draft_tokens: int) -> dict:
        """/health's speculation: the settings, how rank 0 runs its rounds (graphs or eager) and the acceptance
        rate since the service started (accepted / drafted, the /metrics counters: rank 0's counts)."""
        drafted = int(self.metrics.get("v100plan_spec_draft_tokens_total"))
        accepted = int(self.metrics.get("v100plan_spec_accepted_tokens_total"))
        mode = ((self.ranks.get(0) or {}).get("speculation") or {}).get("mode")
        return {"method": "mtp" if draft_tokens else "off", "draft_tokens": draft_tokens or None, "mode": mode,
                "drafted_tokens": drafted, "accepted_tokens": accepted,
                "acceptance_rate": round(accepted / drafted, 4) if drafted else None}

    def _gauges(self, rank: int) -> None:
        d, r = self.ranks[rank], str(rank)
        self.metrics.set("v100plan_decode_mode", 1, rank=r, mode=str(d.get("mode")), kernels=str(d.get("kernels")))
        if d.get("read_bw_gbps"):
            self.metrics.clear("v100plan_decode_read_bw_gbps", rank=r)
            self.metrics.set("v100plan_decode_read_bw_gbps", d["read_bw_gbps"], rank=r,
                             source=str(d.get("read_bw_source")))
        for gauge, key in GAUGES:
            if d.get(key) is not None:
                self.metrics.set(gauge, d[key], rank=r)

    @staticmethod
    def _brief(d: dict, stats: bool = True) -> dict:
        keys = ("mode", "why", "kernels", "kernels_why", "exchange", "read_bw_gbps", "read_bw_source")
        if stats:
            keys += ("steps", "step_ms", "token_ms", "achieved_gbps", "read_bw_fraction")
        return {k: d.get(k) for k in keys}
