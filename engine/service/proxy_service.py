"""The service core: one FIFO queue in front of two ranks, and the restart loop around them.

Admission happens here and only here: every request goes to both ranks in the
order it was taken off this queue, one sequence at a time (the ranks run batch
1). The lifecycle task starts a rank pair, lets the watchdog watch it, and on a
failure ends every pending request with 503, kills both ranks and starts the next
generation; after too many consecutive failed starts it asks serve to exit non-zero.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections import deque
from typing import Callable

from engine.service import concurrency_default, protocol, watchdog
from engine.service.causes import Cause, Failure
from engine.service.proxy_decode import DecodeReport
from engine.service.proxy_jobs import GenerateParams, Job
from engine.service.proxy_log import StructuredLog
from engine.service.proxy_metrics import Metrics
from engine.service.proxy_ranks import RankPair, RankStartError, die_with_parent, rank_env, start_pair
from engine.service.rank_forks import RankForks
from engine.service.serve_config import ALLREDUCE_PATHS, ServeConfig
from engine.service.state_dir import start_time

EXIT_RESTARTS_EXHAUSTED = 3



class Unavailable(Exception):
    """The ranks are not up (starting, restarting or stopping): 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(Exception):
    """More requests are waiting than --queue-cap allows: 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


_PID = re.compile(r"\s*\(pid \d+\)")
_PATH = re.compile(r"(?<![\w.])/[^\s:'\"(),]+")


def public_reason(reason: str) -> str:
    """A failure as clients may read it: its first line, without process ids or file paths
    (the full reason goes to the log and to /health for callers with the key)."""
    line = reason.splitlines()[0] if reason else ""
    return _PATH.sub("<path>", _PID.sub("", line))[:200]


def _restarting(reason: str) -> str:
    return f"the engine's ranks failed ({public_reason(reason)}); the service is restarting them"


def _previous_state(state_dir: str) -> dict:
    """The service.json the previous proxy of this state directory left (its generation, and its
    exit record when it gave up at the restart cap), or {}."""
    try:
        with open(os.path.join(state_dir, "service.json")) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


class Service:
    def __init__(self, cfg: ServeConfig, log: StructuredLog, on_exit: Callable[[int], None],
                 forks: RankForks | None = None):
        self.cfg = cfg
        self.log = log
        self.metrics = Metrics()
        self.decode = DecodeReport(self.metrics, log)  # how the ranks decode and what they achieve
        self.on_exit = on_exit
        self.loop: asyncio.AbstractEventLoop | None = None
        self.state = "starting"            # starting | up | restarting | draining | exiting
        self.pair: RankPair | None = None
        # Generations keep counting across proxy restarts (supervisor), so a generation number
        # names one pair of rank processes for the life of the state directory.
        previous = _previous_state(cfg.state_dir)
        try:
            self.generation = int(previous.get("generation") or 0)
        except (TypeError, ValueError):
            self.generation = 0
        # How the previous proxy ended when it gave up (the restart storm's end): kept in /health.
        self.previous_exit: dict | None = previous.get("exit") if isinstance(previous.get("exit"), dict) else None
        self.exit_record: dict | None = None
        self.last_failure: str | None = None
        self.last_cause: Cause | None = None
        self.queue: deque[Job] = deque()
        self.running: Job | None = None
        self.active: dict[str, Job] = {}  # --max-concurrency above 1: the requests on the ranks (proxy_batch)
        # The requests decoded at once and what chose it (engine/service/concurrency_default.py): serve's flags and
        # the model decided it, or (None until then) the first rank pair chose it from its cards' memory; every
        # later pair is started with that figure, so the worker below never changes kind.
        self.max_concurrency: int | None = cfg.max_concurrency
        self.concurrency: dict = concurrency_default.record(cfg.max_concurrency, cfg.concurrency_bound,
                                                            cfg.concurrency_why)
        self._concurrency_known = asyncio.Event()
        self.budget = watchdog.RestartBudget(cfg.max_restarts)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # Every start forks its ranks from a process that imported torch once (the first too)
        # (serve passes the one it started before its own imports)
        self._forks = forks or (RankForks(os.path.join(cfg.state_dir, "logs", "rank-forks.log"), die_with_parent,
                                          rank_env(), gpu=cfg.gpu)
                                if cfg.standby_ranks else None)
        self._recent_durations_s: deque[float] = deque(maxlen=8)
        # Fault injection ("fail_starts"): this many coming rank starts get a failing self-test on rank 1.
        self.fail_starts_armed = 0
        self._known: dict | None = None  # what a restart reuses of the last pair's start (_remember)
        self._inherited = self._read_reuse()

    # ----- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.loop = loop
        if self.previous_exit is not None:
            self.log.emit("previous_exit", **self.previous_exit)
        self._tasks = [loop.create_task(self._lifecycle()), loop.create_task(self._work())]

    async def _work(self) -> None:
        """The worker that feeds the ranks: one request at a time, or up to N (proxy_batch), once N is known."""
        if self.max_concurrency is None:
            await self._concurrency_known.wait()
        if self.max_concurrency > 1:
            from engine.service.proxy_batch import Batch

            await Batch(self).worker()
        else:
            await self._worker()

    async def drain(self, timeout_s: float) -> None:
        """SIGTERM/SIGINT: take no new request (503), let the running and queued ones finish for
        up to `timeout_s`, then end what is left with 503 (an SSE error event + [DONE] on streams).
        The watchdog stops restarting ranks from here on."""
        if self.state in ("draining", "exiting"):
            return
        self.state = "draining"
        self.metrics.set("v100plan_ranks_up", 0)
        self._write_state()
        self.log.emit("drain", running=self.running.id if self.running else None, queued=len(self.queue),
                      timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        while (self.running is not None or self.active or self.queue) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = (1 if self.running is not None else 0) + len(self.active) + len(self.queue)
        self._fail_pending(503, "the service is shutting down")
        self.log.emit("drained", unfinished=left)

    async def stop(self) -> None:
        """Serve is shutting down (SIGTERM, SIGINT or the restart cap): end requests, stop both ranks."""
        self.state = "exiting"
        for task in self._tasks:  # the watchdog first: the ranks' exit below is no failure
            task.cancel()
        self._fail_pending(503, "the service is shutting down")
        pids = self.pair.pids if self.pair else []
        if self.pair is not None:
            await self.pair.close()
            self.pair = None
        if self._forks is not None:
            await self._forks.close()
        self._write_state()
        self.log.emit("serve_stop", generation=self.generation, rank_pids_stopped=pids)

    async def _lifecycle(self) -> None:
        previous: Failure | None = None
        while True:
            pair = await self._bring_up(previous)
            if pair is None:
                return
            previous = await watchdog.watch(
                pair, self._busy_since, self.cfg.stall_timeout_s, self.cfg.ping_interval_s,
                self.cfg.liveness_timeout_s or None,
            )
            await self._take_down(pair, previous)
            if self.state in ("draining", "exiting"):
                return  # shutting down: no new generation

    async def _bring_up(self, failure: Failure | None) -> RankPair | None:
        after_failure = failure.reason if failure is not None else None
        cause = failure.cause if failure is not None else None  # of the failure this start follows
        while True:
            self.generation += 1
            if cause is not None:
                self.metrics.inc("v100plan_rank_restarts_total", cause=cause.value)
            self._publish_down("restarting" if after_failure is not None else "starting")
            t0 = time.monotonic()
            if self._forks is not None and self._forks.proc is None:
                # The first start of this proxy forks its ranks too: one import of torch (the fork
                # server's) instead of one per rank at once, which is most of a start after the
                # proxy itself was restarted (kill_proxy). A fork server that died later is only
                # started again once a pair runs (below).
                await self._start_forks()
                if self._forks.adopted:
                    self._take_over_reuse()
            try:
                forks = self._forks if self._forks is not None and self._forks.alive else None
                fault = self._start_fault()
                reused = self._known if not fault else None
                pair = await start_pair(self.cfg, self.generation, fault, forks, self._pinned(self._flags(reused)))
            except RankStartError as exc:
                cause = exc.cause
                self._known = None  # the next start measures and races again
                self.budget.record(False)
                self.metrics.inc("v100plan_rank_restart_failures_total")
                self.last_failure = str(exc)
                self.log.emit("rank_start_failed", generation=self.generation, reason=str(exc), cause=exc.cause.value,
                              consecutive_failures=self.budget.consecutive_failures,
                              max_restarts=self.cfg.max_restarts)
                if self.budget.exhausted:
                    self.state = "exiting"
                    self.exit_record = {
                        "code": EXIT_RESTARTS_EXHAUSTED, "cause": exc.cause.value, "unix": round(time.time(), 3),
                        "reason": f"{self.budget.consecutive_failures} consecutive failed rank starts "
                                  f"(--max-restarts {self.cfg.max_restarts}); the last: {public_reason(str(exc))}"}
                    self.log.emit("exit", **self.exit_record)
                    self._write_state()
                    self.on_exit(EXIT_RESTARTS_EXHAUSTED)
                    return None
                await asyncio.sleep(self.budget.backoff_s())
                continue
            self.budget.record(True)
            self._remember(pair, reused)
            if self.state in ("draining", "exiting"):  # a signal came during the start: no new pair
                await pair.close(grace_s=0.5)
                return None
            self.pair = pair
            self._take_concurrency(pair)
            self.state = "up"
            self.metrics.set("v100plan_ranks_up", 1)
            self.metrics.set("v100plan_rank_generation", pair.generation)
            if pair.allreduce:
                self.metrics.set_only("v100plan_allreduce_path", 1, path=pair.allreduce)
            self.log.emit("restart" if after_failure is not None else "ranks_up",
                          generation=pair.generation, rank_pids=pair.pids, allreduce=pair.allreduce,
                          race=pair.race, max_context=pair.max_context, context=pair.context,
                          max_concurrency=self.max_concurrency, concurrency=self.concurrency,
                          start_s=round(time.monotonic() - t0, 3),
                          after=after_failure, forked=forks is not None)
            self.decode.ranks_up(pair.links)
            self._write_state()
            self._wake.set()
            if self._forks is not None and not self._forks.alive and self.state == "up":
                await self._start_forks()
            return pair

    async def _start_forks(self) -> None:
        try:
            await self._forks.start()
            self.log.emit("rank_forks_started", pid=self._forks.proc.pid, adopted=self._forks.adopted)
        except OSError as exc:
            self.log.emit("rank_forks_failed", reason=str(exc))

    def _remember(self, pair: RankPair, reused: dict | None) -> None:
        """What a restart of this pair need not do again (docs/service.md, "Start-up"): each rank's measured read
        bandwidth (the same card) and, where the path was raced (--allreduce auto), the path that won: a restart
        self-tests that path alone. The race shown stays the one that chose it (``reused``: what this start
        reused). A failed start forgets both. service.json keeps them for the next proxy, which takes them only
        with this one's fork server."""
        if reused is not None and pair.race is None:
            pair.race = reused.get("race") if isinstance(reused.get("race"), dict) else None
        bws = []
        for link in pair.links:
            dec = (link.ready or {}).get("decode") or {}
            ok = dec.get("read_bw_source") in ("measured", "measured earlier")
            bws.append(dec.get("read_bw_gbps") if ok else None)
        self._known = {"read_bw_gbps": bws, "allreduce": pair.allreduce if self.cfg.allreduce == "auto" else None,
                       "race": pair.race, "for": self._reuse_key()}

    def _reuse_key(self) -> list:
        c = self.cfg
        return [c.model_dir, list(c.devices), c.dtype, c.allreduce]

    @staticmethod
    def _flags(known: dict | None) -> tuple[tuple[str, ...], ...]:
        """Each rank's flags that reuse ``known`` (none without it)."""
        if known is None:
            return ((), ())
        flags = []
        for bw in (list(known.get("read_bw_gbps") or []) + [None, None])[:2]:
            mine: tuple[str, ...] = ()
            if isinstance(bw, (int, float)) and not isinstance(bw, bool) and 0 < bw < 1e6:
                mine = ("--read-bw-gbps", str(float(bw)), "--read-bw-source", "measured earlier")
            if known.get("allreduce") in ALLREDUCE_PATHS:
                mine += ("--allreduce", known["allreduce"])
            flags.append(mine)
        return tuple(flags)

    def _pinned(self, flags: tuple[tuple[str, ...], ...]) -> tuple[tuple[str, ...], ...]:
        """Each rank's flags, with the first pair's memory-chosen N once there is one (the rank's last
        --max-concurrency wins over serve's `memory`)."""
        if self.cfg.max_concurrency is not None or self.max_concurrency is None:
            return flags
        return tuple(f + ("--max-concurrency", str(self.max_concurrency)) for f in flags)

    def _take_concurrency(self, pair: RankPair) -> None:
        """The first pair's memory-chosen N (and why) becomes the service's, for good."""
        if self.max_concurrency is not None:
            return
        chosen = pair.concurrency or concurrency_default.record(1, "memory", "the ranks did not say; one at a time")
        self.max_concurrency = int(chosen["max_concurrency"])
        self.concurrency = dict(chosen)
        self._concurrency_known.set()

    def _read_reuse(self) -> dict | None:
        """What the previous proxy of this state dir left in service.json (read before this one rewrites it)."""
        try:
            with open(os.path.join(self.cfg.state_dir, "service.json")) as fh:
                known = json.load(fh).get("restart_reuse")
        except (OSError, ValueError, AttributeError):
            return None
        return known if isinstance(known, dict) and known.get("for") == self._reuse_key() else None

    def _take_over_reuse(self) -> None:
        """A proxy that took over its predecessor's fork server (the same service, restarted by its supervisor)
        takes over what that one's pair measured too (the state dir is this user's own: serve checks it)."""
        if self._inherited is not None:
            self._known, self._inherited = self._inherited, None

    def _start_fault(self) -> tuple[str, ...]:
        """Rank 1's flags that make this start's allreduce self-test fail, while a storm is armed."""
        if self.fail_starts_armed <= 0:
            return ()
        self.fail_starts_armed -= 1
        paths = ALLREDUCE_PATHS[1:] if self.cfg.allreduce == "auto" else (self.cfg.allreduce,)
        return tuple(arg for p in paths for arg in ("--fail-selftest", p))

    async def _take_down(self, pair: RankPair, failure: Failure) -> None:
        reason = failure.reason
        self.last_failure = reason
        self.last_cause = failure.cause
        if failure.cause is Cause.LOCKSTEP:
            self.metrics.inc("v100plan_lockstep_failures_total")
        self.metrics.inc("v100plan_rank_failures_total", cause=failure.cause.value)
        self._publish_down("restarting" if self.state not in ("draining", "exiting") else self.state)
        self.log.emit("rank_failure", generation=pair.generation, rank_pids=pair.pids, reason=reason,
                      cause=failure.cause.value, rank=failure.rank,
                      in_flight=self.running.id if self.running else sorted(self.active) or None)
        self._fail_pending(503, _restarting(reason) if self.state == "restarting" else
                           "the service is shutting down")
        await pair.close()
        self.pair = None

    def _publish_down(self, state: str) -> None:
        self.state = state
        self.metrics.set("v100plan_ranks_up", 0)
        self._write_state()

    def _fail_pending(self, status: int, message: str) -> None:
        if self.running is not None:
            self.running.finish(("error", status, message))
        for job in list(self.active.values()):
            job.finish(("error", status, message))
        while self.queue:
            self.queue.popleft().finish(("error", status, message))
        self.metrics.set("v100plan_queue_depth", 0)

    def _busy_since(self) -> float | None:
        job = self.running
        if self.active:  # several: the latest start (the ranks' counter moves while any of them runs)
            starts = [j.started_monotonic for j in self.active.values() if j.state == "running" and j.started_monotonic]
            return max(starts) if starts else None
        return job.started_monotonic if job is not None and job.state == "running" else None

    def _write_state(self) -> None:
        """service.json in the state dir: who is running now (supervise stop and the acceptance
        suite read it to find the rank PIDs)."""
        doc = {
            "proxy_pid": os.getpid(), "state": self.state, "generation": self.generation,
            "rank_pids": self.pair.pids if self.pair else [], "allreduce": self.pair.allreduce if self.pair else None,
            "host": self.cfg.host, "port": self.cfg.port, "last_failure": self.last_failure,
            "updated_unix": round(time.time(), 3),
        }
        if self.exit_record is not None:
            doc["exit"] = self.exit_record
        if self._known is not None:
            doc["restart_reuse"] = self._known
        # Each PID's start time: `supervise stop` signals a PID only when it is still that process.
        doc["start_times"] = {str(pid): start_time(pid) for pid in [os.getpid(), *doc["rank_pids"]]}
        os.makedirs(self.cfg.state_dir, mode=0o700, exist_ok=True)
        path = os.path.join(self.cfg.state_dir, "service.json")
        tmp = path + f".{os.getpid()}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as fh:
            json.dump(doc, fh, indent=1)
        os.replace(tmp, path)

    # ----- admission -----------------------------------------------------------------

    def retry_after_s(self) -> int:
        per = (sum(self._recent_durations_s) / len(self._recent_durations_s)) if self._recent_durations_s else 1.0
        return max(1, int(per * (len(self.queue) + 1) + 0.999))

    def submit(self, params: GenerateParams, endpoint: str) -> Job:
        if self.state == "up" and self.pair is not None and self.pair.failure is not None:
            self.last_failure = self.pair.failure.reason  # found dead a moment ago; the watchdog is on it
            self.state = "restarting"
        if self.state != "up":
            self._count_outcome("unavailable")
            raise Unavailable(
                f"the engine is {self.state}"
                + (f" after: {public_reason(self.last_failure)}"
                   if self.last_failure and self.state != "draining" else ""),
                retry_after_s=10 if self.state == "starting" else 5,
            )
        n = self.max_concurrency or 1
        free = max(0, n - len(self.active)) if n > 1 else 0
        if len(self.queue) >= self.cfg.queue_cap + free and (self.running is not None or self.active or self.queue):
            self._count_outcome("queue_full")
            raise QueueFull(f"{len(self.queue)} requests are already waiting (--queue-cap {self.cfg.queue_cap})",
                            retry_after_s=self.retry_after_s())
        job = Job(params=params, endpoint=endpoint, on_outcome=self._count_outcome)
        self.queue.append(job)
        self.metrics.set("v100plan_queue_depth", len(self.queue))
        self._wake.set()
        return job

    def slots_busy(self) -> int:
        """Requests on the ranks now (/health)."""
        return len(self.active) if (self.max_concurrency or 1) > 1 else int(self.running is not None)

    def slots(self) -> list[dict]:
        """Each request on the ranks now, oldest first (keyed /health): its id and the positions its sequence holds
        (prompt + tokens generated so far: the context its slot serves)."""
        jobs = list(self.active.values()) if (self.max_concurrency or 1) > 1 else [j for j in (self.running,) if j]
        return [{"request": j.id, "prompt_tokens": len(j.params.prompt_ids), "completion_tokens": j.completion_tokens,
                 "context_tokens": len(j.params.prompt_ids) + j.completion_tokens}
                for j in sorted(jobs, key=lambda j: j.started_monotonic or 0.0)]

    def _count_outcome(self, outcome: str) -> None:
        self.metrics.inc("v100plan_request_outcomes_total", outcome=outcome)

    def withdraw(self, job: Job) -> None:
        """The client went away: drop a queued job, cancel a running one on both ranks."""
        job.cancel("client_gone")
        if job.state == "queued":
            try:
                self.queue.remove(job)
            except ValueError:
                pass
            job.finish(("done", "cancelled", {"prompt_tokens": 0, "completion_tokens": 0}))
            self.metrics.set("v100plan_queue_depth", len(self.queue))

    # ----- the one worker ------------------------------------------------------------

    async def take_job(self, full=None):  # noqa: ANN001, ANN201 - () -> bool; a Job
        """The next queued job, once the pair is up to run it (and ``full()``, when given, says there is room)."""
        while True:
            while (not self.queue or (full is not None and full()) or self.state not in ("up", "draining")
                   or self.pair is None or self.pair.failure is not None):
                self._wake.clear()
                await self._wake.wait()
            job = self.queue.popleft()
            self.metrics.set("v100plan_queue_depth", len(self.queue))
            if job.state == "queued":
                return job

    async def _worker(self) -> None:
        while True:
            job = await self.take_job()
            pair = self.pair
            self.running = job
            self.metrics.set("v100plan_requests_running", 1)
            try:
                await self._run(job, pair)
            except (ConnectionError, OSError) as exc:
                pair.fail(Failure(Cause.CONTROL, f"rank control socket: {exc}"))
                job.finish(("error", 503, _restarting(pair.failure.reason)))
            finally:
                self.running = None
                self.metrics.set("v100plan_requests_running", 0)
                if job.started_monotonic is not None:
                    self._recent_durations_s.append(time.monotonic() - job.started_monotonic)

    async def _run(self, job: Job, pair: RankPair) -> None:
        job.state = "running"
        job.generation = pair.generation
        job.rank_pids = pair.pids
        job.started_monotonic = time.monotonic()
        for link in pair.links:
            link.ping_sent_monotonic = None  # liveness comes from the request's progress now
        message = job.params.message(job.id)
        for link in pair.links:
            await link.send(message)
        done: list[dict | None] = [None, None]
        getter = asyncio.ensure_future(pair.queue.get())
        try:
            while not (done[0] and done[1]):
                if pair.failure is not None:
                    job.finish(("error", 503, _restarting(pair.failure.reason)))
                    return
                if job.state == "finished":
                    return
                if job.cancel_reason is not None and not job.cancel_sent:
                    job.cancel_sent = True
                    for link in pair.links:
                        await link.send(protocol.cancel(job.id))
                await asyncio.wait({getter}, timeout=watchdog.tick_s(self.cfg.stall_timeout_s))
                if not getter.done():
                    continue
                msg = getter.result()
                getter = asyncio.ensure_future(pair.queue.get())
                self._handle(job, msg, done)
        finally:
            getter.cancel()
        self._finish(job, done)

    def _handle(self, job: Job, msg: dict, done: list) -> None:
        rank, kind = msg.get("_rank"), msg.get("type")
        if kind in ("eof", "fatal"):
            return  # the watchdog names the failure on its next tick
        if msg.get("id") != job.id:
            return  # a late message for an earlier, already finished request
        if kind in ("done", "error"):
            done[rank] = msg
            job.rank_finish[rank] = msg.get("finish_reason") or "error"
            return
        if rank != 0:
            return  # rank 1's tokens are read (to keep its socket drained) and dropped
        if kind == "token":
            now = time.monotonic()
            if job.last_token_monotonic is None:
                self.metrics.observe("v100plan_time_to_first_token_seconds", now - job.submitted_monotonic)
            else:
                self.metrics.observe("v100plan_time_per_output_token_seconds", now - job.last_token_monotonic)
            job.last_token_monotonic = now
            job.completion_tokens += 1
            job.events.put_nowait(("token", msg["token_id"], msg.get("logprobs")))
        elif kind == "progress":
            job.events.put_nowait(("progress", msg.get("done_tokens")))

    def _finish(self, job: Job, done: list) -> None:
        errors = [d for d in done if d.get("type") == "error"]
        if errors:
            # The ranks refused or failed this one request (they stay up); the API validates
            # every input first, so this is the engine's fault, not the client's. The detail
            # goes to the log, not to the client.
            detail = "; ".join(f"rank {d['_rank']}: {d.get('message')}" for d in errors)
            self.log.emit("request_failed_on_ranks", id=job.id, reason=detail)
            self.metrics.inc("v100plan_request_errors_total")
            job.finish(("error", 500, "the engine could not complete this request (see the service log)"))
            return
        self.decode.after_request(done)
        r0 = done[0]
        usage = {"prompt_tokens": r0.get("prompt_tokens", len(job.params.prompt_ids)),
                 "completion_tokens": r0.get("completion_tokens", job.completion_tokens),
                 "cached_tokens": int(r0.get("cached_tokens") or 0)}
        reason = r0.get("finish_reason")
        if reason == "cancelled":
            self.metrics.inc("v100plan_cancelled_total")
        self.metrics.inc("v100plan_prompt_tokens_total", usage["prompt_tokens"])
        if usage["cached_tokens"]:
            self.metrics.inc("v100plan_prefix_cache_hits_total")
            self.metrics.inc("v100plan_prefix_cache_reused_tokens_total", usage["cached_tokens"])
        self.metrics.inc("v100plan_completion_tokens_total", job.completion_tokens)
        spec = (r0.get("decode") or {}).get("spec")
        if spec:  # --speculative mtp: this request's drafts and how many the verification accepted
            self.metrics.inc("v100plan_spec_draft_tokens_total", spec["draft_tokens"])
            self.metrics.inc("v100plan_spec_accepted_tokens_total", spec["accepted_tokens"])
        job.finish(("done", reason, usage))

    # ----- fault injection (control.py) ------------------------------------------------

    async def send_fault(self, rank: int, what: str, at_step: int | None) -> dict:
        """Arm one of the rank's fault hooks (needs --enable-fault-injection on serve)."""
        pair = self.pair
        if pair is None or self.state != "up":
            raise Unavailable(f"the engine is {self.state}", retry_after_s=1)
        link = pair.links[rank]
        while not link.fault_replies.empty():
            link.fault_replies.get_nowait()
        await link.send(protocol.fault(what, at_step))
        try:
            reply = await asyncio.wait_for(link.fault_replies.get(), 5.0)
        except asyncio.TimeoutError:
            return {"type": "fault_armed", "rank": rank, "what": what, "confirmed": False}
        return {**reply, "confirmed": True}
