"""The proxy's side of ``--max-concurrency N`` > 1: up to N requests on the ranks at once.

The worker takes requests off the service's queue in order while fewer than N run, sends each to both ranks
(every generate and cancel message goes to rank 0 then rank 1 under one lock, so both ranks receive the same
two sequences: engine/service/rank_batch.py agrees on them step by step), and runs one task per request that
reads that request's messages; a dispatcher routes both ranks' messages to those tasks by request id.
"""

from __future__ import annotations

import asyncio
import time

from engine.service import protocol, watchdog
from engine.service.causes import Cause, Failure
from engine.service.proxy_jobs import Job
from engine.service.proxy_ranks import RankPair


class Batch:
    def __init__(self, service):
        self.svc = service
        self.n = service.max_concurrency  # serve's flags' or the first rank pair's (proxy_service._take_concurrency)
        self.inboxes: dict[str, asyncio.Queue] = {}
        self.send_lock = asyncio.Lock()
        self._dispatch: asyncio.Task | None = None
        self._dispatch_pair: RankPair | None = None

    async def worker(self) -> None:
        svc = self.svc
        while True:
            job = await svc.take_job(full=lambda: len(svc.active) >= self.n)
            pair = svc.pair
            if self._dispatch_pair is not pair:
                if self._dispatch is not None:
                    self._dispatch.cancel()
                self._dispatch_pair = pair
                self._dispatch = asyncio.get_running_loop().create_task(self._route(pair))
            svc.active[job.id] = job
            self.inboxes[job.id] = asyncio.Queue()
            svc.metrics.set("v100plan_requests_running", len(svc.active))
            job.state = "running"
            job.generation, job.rank_pids = pair.generation, pair.pids
            job.started_monotonic = time.monotonic()
            await self._send(pair, job.params.message(job.id))
            asyncio.get_running_loop().create_task(self._one(job, pair))

    async def _send(self, pair: RankPair, message: dict) -> None:
        async with self.send_lock:
            for link in pair.links:
                await link.send(message)

    async def _route(self, pair: RankPair) -> None:
        """Both ranks' messages to the request they name (eof and fatal: the watchdog's)."""
        while True:
            msg = await pair.queue.get()
            inbox = self.inboxes.get(msg.get("id"))
            if inbox is not None:
                inbox.put_nowait(msg)

    async def _one(self, job: Job, pair: RankPair) -> None:
        svc = self.svc
        inbox = self.inboxes[job.id]
        done: list[dict | None] = [None, None]
        try:
            for link in pair.links:
                link.ping_sent_monotonic = None  # liveness comes from the requests' progress now
            while not (done[0] and done[1]):
                if pair.failure is not None:
                    job.finish(("error", 503, "the engine's ranks failed; the service is restarting them"))
                    return
                if job.state == "finished":
                    return
                if job.cancel_reason is not None and not job.cancel_sent:
                    job.cancel_sent = True
                    await self._send(pair, protocol.cancel(job.id))
                try:
                    msg = await asyncio.wait_for(inbox.get(), watchdog.tick_s(svc.cfg.stall_timeout_s))
                except asyncio.TimeoutError:
                    continue
                svc._handle(job, msg, done)
            svc._finish(job, done)
        except (ConnectionError, OSError) as exc:
            pair.fail(Failure(Cause.CONTROL, f"rank control socket: {exc}"))
            job.finish(("error", 503, "the engine's ranks failed; the service is restarting them"))
        finally:
            self.inboxes.pop(job.id, None)
            svc.active.pop(job.id, None)
            svc.metrics.set("v100plan_requests_running", len(svc.active))
            if job.started_monotonic is not None:
                svc._recent_durations_s.append(time.monotonic() - job.started_monotonic)
            svc._wake.set()
