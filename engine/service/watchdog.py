"""The watchdog: decides when a rank generation is dead, and how many restarts are allowed.

A generation is dead when a rank process exits, closes its control socket, sends a
fatal message (LOCKSTEP FAILURE among them), falls silent, or stops making progress:

- liveness (seconds, busy or idle): each rank sends a heartbeat every second from a
  thread of its own; a rank silent for liveness_timeout_s is frozen or gone, and a
  rank that reports waiting for its peer inside one allreduce for liveness_timeout_s
  names a stalled peer (the waiting rank is fine: it keeps beating);
- progress (the step watchdog, docs/field-figures.md's 180 s field default): during a request, a
  rank whose progress counter (carried by every token, prefill chunk and heartbeat)
  did not move for stall_timeout_s; while idle, an unanswered ping for stall_timeout_s.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from engine.service import protocol
from engine.service.causes import Cause, Failure, exit_cause
from engine.service.proxy_ranks import RankPair


def pair_failure(pair: RankPair, busy_since_monotonic: float | None, stall_timeout_s: float,
                 now: float | None = None, liveness_timeout_s: float | None = None) -> Failure | None:
    """Why this pair is dead, with its cause, or None. `busy_since_monotonic` is when the running
    request was sent to the ranks (None when idle); `liveness_timeout_s` None: no heartbeat check.

    A rank that died or broke the lockstep is the failure's origin; a peer's fatal message (its
    allreduce failed because the other rank is gone) is only read when neither is seen."""
    now = time.monotonic() if now is None else now
    for link in pair.links:
        if link.fatal_cause is Cause.LOCKSTEP:
            return Failure(Cause.LOCKSTEP, f"rank {link.rank} fatal: {link.fatal_message}", link.rank)
    for link in pair.links:
        if link.exited and link.fatal_message is None:
            return Failure(exit_cause(link.proc.returncode),
                           f"rank {link.rank} (pid {link.pid}) exited with code {link.proc.returncode}", link.rank)
        if link.eof and link.fatal_message is None:
            return Failure(Cause.EXIT, f"rank {link.rank} (pid {link.pid}) closed its control socket", link.rank)
    for link in pair.links:
        if link.fatal_message is not None:
            return Failure(link.fatal_cause or Cause.EXIT, f"rank {link.rank} fatal: {link.fatal_message}", link.rank)
    if liveness_timeout_s:
        for link in pair.links:
            silent_s = now - link.last_message_monotonic
            if silent_s > liveness_timeout_s:
                return Failure(Cause.LIVENESS, f"rank {link.rank} (pid {link.pid}) sent no heartbeat for "
                               f"{silent_s:.1f} s (frozen or stuck; liveness timeout {liveness_timeout_s:g} s)",
                               link.rank)
        for link in pair.links:
            if link.wait_s > liveness_timeout_s:
                peer = pair.links[1 - link.rank]
                return Failure(Cause.PEER_WAIT, f"rank {peer.rank} (pid {peer.pid}) stalled: rank {link.rank} has "
                               f"waited {link.wait_s:.1f} s for it in an allreduce (liveness timeout "
                               f"{liveness_timeout_s:g} s)", peer.rank)
    for link in pair.links:
        if busy_since_monotonic is not None:
            quiet_s = now - max(link.last_progress_monotonic, busy_since_monotonic)
            if quiet_s > stall_timeout_s:
                return Failure(Cause.STALL, f"rank {link.rank} (pid {link.pid}) made no progress for {quiet_s:.1f} s "
                               f"(counter {link.last_counter}, stall timeout {stall_timeout_s:g} s)", link.rank)
        elif link.ping_sent_monotonic is not None and now - link.ping_sent_monotonic > stall_timeout_s:
            return Failure(Cause.STALL, f"rank {link.rank} (pid {link.pid}) did not answer a ping for "
                           f"{now - link.ping_sent_monotonic:.1f} s (stall timeout {stall_timeout_s:g} s)", link.rank)
    return None


async def ping_idle_ranks(pair: RankPair, ping_interval_s: float) -> None:
    """Send a ping to each rank that has been quiet for ping_interval_s and has none pending."""
    now = time.monotonic()
    for link in pair.links:
        if link.ping_sent_monotonic is None and now - link.last_message_monotonic > ping_interval_s:
            link.ping_sent_monotonic = now
            try:
                await link.send(protocol.ping())
            except (ConnectionError, OSError):
                pass  # the EOF / exit check reports it on the next tick


@dataclass
class RestartBudget:
    """Counts consecutive failed starts; a start that comes up resets the count."""

    max_consecutive_failures: int
    consecutive_failures: int = 0

    def record(self, came_up: bool) -> None:
        self.consecutive_failures = 0 if came_up else self.consecutive_failures + 1

    @property
    def exhausted(self) -> bool:
        # The first start counts too: max_restarts=3 allows the first start plus 3 retries.
        return self.consecutive_failures > self.max_consecutive_failures

    def backoff_s(self) -> float:
        return min(5.0, 0.5 * (2 ** max(0, self.consecutive_failures - 1)))


def tick_s(stall_timeout_s: float) -> float:
    return max(0.02, min(0.25, stall_timeout_s / 20))


async def watch(pair: RankPair, busy_since, stall_timeout_s: float, ping_interval_s: float,
                liveness_timeout_s: float | None = None) -> Failure:
    """Return the failure once `pair` is dead. `busy_since()` gives the running request's start."""
    step = min(tick_s(stall_timeout_s), tick_s(liveness_timeout_s or stall_timeout_s))
    while True:
        if pair.failure is not None:
            return pair.failure
        since = busy_since()
        reason = pair_failure(pair, since, stall_timeout_s, liveness_timeout_s=liveness_timeout_s)
        if reason is not None:
            pair.fail(reason)
            return pair.failure
        if since is None:
            await ping_idle_ranks(pair, ping_interval_s)
        await asyncio.sleep(step)
