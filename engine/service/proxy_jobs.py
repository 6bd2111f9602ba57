"""A request on its way through the service: what the ranks are asked, and the events back.

The service (proxy_service.py) feeds a Job's event queue with token ids; the HTTP
layer (app.py) turns them into text. Events, in order:
  ("progress", done_tokens)            after each prefill chunk (rank 0)
  ("token", token_id, logprobs)        rank 0's token, after that step's lockstep passed (logprobs: None
                                       unless asked: [logprob, [[id, logprob], ...]])
  ("done", finish_reason, usage)       both ranks are finished; usage = {prompt_tokens, completion_tokens}
  ("error", http_status, message)      the request cannot complete (rank failure, rank error)
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.service import protocol

_ids = itertools.count(1)


def outcome(event: tuple) -> str:
    """How a request ended, for /metrics: its finish reason, or what its error status means."""
    if event[0] == "done":
        return str(event[1])
    return {503: "unavailable", 500: "failed"}.get(event[1], f"error_{event[1]}")


@dataclass(frozen=True)
class GenerateParams:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int                     # drawn by the proxy when the client gave none; same on both ranks
    stop_token_ids: tuple[int, ...]
    sampling: dict | None = None  # top_k, min_p, penalties, logit_bias, logprobs (protocol.generate)
    grammar: dict | None = None   # a constrained answer's grammar (engine.core.grammar)
    images: tuple[str, ...] = ()  # base64 of each image's file bytes, in prompt order (engine.service.images)

    def message(self, request_id: str) -> dict:
        return protocol.generate(request_id, list(self.prompt_ids), self.max_tokens, self.temperature,
                                 self.top_p, self.seed, list(self.stop_token_ids), self.sampling, self.grammar,
                                 images=list(self.images))


@dataclass
class Job:
    params: GenerateParams
    endpoint: str
    id: str = field(default_factory=lambda: f"r{next(_ids)}")
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: str = "queued"          # queued -> running -> finished
    cancel_reason: str | None = None   # "client_gone" or "stop" once cancel() was called
    cancel_sent: bool = False
    submitted_monotonic: float = field(default_factory=time.monotonic)
    started_monotonic: float | None = None
    generation: int | None = None
    rank_pids: list[int] | None = None
    completion_tokens: int = 0
    rank_finish: list[str | None] = field(default_factory=lambda: [None, None])
    on_finish: Callable[[tuple], None] | None = None   # e.g. the deferred request log line
    on_outcome: Callable[[str], None] | None = None    # counts how it ended (/metrics)
    last_token_monotonic: float | None = None

    def log_fields(self) -> dict:
        return {"id": self.id, "generation": self.generation, "rank_pids": self.rank_pids,
                "completion_tokens": self.completion_tokens, "rank_finish": list(self.rank_finish)}

    def cancel(self, reason: str) -> None:
        """Ask both ranks to stop this request (the service sends the cancel message)."""
        if self.cancel_reason is None:
            self.cancel_reason = reason

    def finish(self, event: tuple) -> None:
        if self.state != "finished":
            self.state = "finished"
            self.events.put_nowait(event)
            if self.on_outcome is not None:
                self.on_outcome(outcome(event))
            if self.on_finish is not None:
                self.on_finish(event)
