"""Fault-injection control for the acceptance suite: /control/* routes.

Mounted only with `serve --enable-fault-injection`, which needs an API key: answered only to
loopback clients that send it (another local user cannot kill a rank), and listed in no
/openapi.json. The targets are the
processes of the current rank generation; the injections are signals (kill,
freeze, thaw), the ranks' own fault hooks (corrupt_hash, stall_allreduce, exit at a
step; the ranks were started with --enable-fault-injection too), and killing the
proxy itself (its supervisor must bring it back).
"""

from __future__ import annotations

import asyncio
import os
import signal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from engine.service.app_http import ApiError, check_api_key
from engine.service.causes import ACTIONS
from engine.service.proxy_service import Service, Unavailable
from engine.service.serve_config import host_is_loopback

# The actions are engine/service/causes.py's fault table. kill_proxy: the supervisor must bring the
# proxy back. fail_starts: the next `count` rank starts fail their allreduce self-test on rank 1 (real
# rank processes that refuse to come up), so a kill now starts a restart storm that reaches
# --max-restarts and makes serve exit non-zero.
SIGNALS = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP, "thaw": signal.SIGCONT}


class Injection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    action: str
    rank: StrictInt | None = Field(default=None, ge=0, le=1)
    at_step: StrictInt | None = Field(default=None, ge=0)
    count: StrictInt | None = Field(default=None, ge=1, le=100)


def register_control(app: FastAPI, service: Service) -> None:
    cfg = service.cfg

    def guard(request: Request) -> None:
        client = request.client.host if request.client else ""
        if not host_is_loopback(client):
            raise ApiError(403, "the control interface answers loopback clients only", kind="permission_error")
        check_api_key(request, cfg.api_key)

    @app.get("/control/targets", include_in_schema=False)
    async def targets(request: Request):
        guard(request)
        pair = service.pair
        return {
            "proxy_pid": os.getpid(), "state": service.state, "generation": service.generation,
            "allreduce": pair.allreduce if pair else None,
            "ranks": [{"rank": link.rank, "pid": link.pid, "alive": not link.exited} for link in pair.links]
            if pair else [],
            "actions": list(ACTIONS),
        }

    @app.get("/control/events", include_in_schema=False)
    async def events(request: Request, since: int = 0):
        """The structured log's recent events after sequence number `since` (the acceptance suite
        reads each fault's rank_failure here when it cannot read the state directory)."""
        guard(request)
        return {"events": service.log.since(since), "last_seq": service.log.seq, "proxy_pid": os.getpid()}

    @app.post("/control/inject", include_in_schema=False)
    async def inject(body: Injection, request: Request):
        guard(request)
        if body.action not in ACTIONS:
            raise ApiError(400, f"action {body.action!r}: choose one of {', '.join(ACTIONS)}", "action")
        if body.action == "kill_proxy":
            # Answer first, then die by SIGKILL (no clean-up: that is the point of the test).
            asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGKILL)
            return {"action": "kill_proxy", "pid": os.getpid(), "generation": service.generation}
        if body.action == "fail_starts":
            if body.count is None:
                raise ApiError(400, "action 'fail_starts' needs a count (1-100)", "count")
            service.fail_starts_armed = body.count
            service.log.emit("fault_armed", action="fail_starts", count=body.count)
            return {"action": "fail_starts", "count": body.count, "generation": service.generation}
        if body.rank is None:
            raise ApiError(400, f"action {body.action!r} needs a rank (0 or 1)", "rank")
        pair = service.pair
        if pair is None or service.state != "up":
            raise ApiError(503, f"the engine is {service.state}: no rank to act on", headers={"Retry-After": "1"})
        link = pair.links[body.rank]
        result = {"action": body.action, "rank": body.rank, "pid": link.pid, "generation": pair.generation}
        if body.action in SIGNALS:
            try:
                os.kill(link.pid, SIGNALS[body.action])
            except ProcessLookupError:
                raise ApiError(409, f"rank {body.rank} (pid {link.pid}) is already gone") from None
            return result
        try:
            reply = await service.send_fault(body.rank, body.action, body.at_step)
        except Unavailable as exc:
            raise ApiError(503, str(exc), headers={"Retry-After": "1"}) from None
        except (ConnectionError, OSError) as exc:
            raise ApiError(409, f"rank {body.rank}: {exc}") from None
        return {**result, "at_step": body.at_step, "armed": reply.get("confirmed", False)}
