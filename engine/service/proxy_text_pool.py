"""Prompt text -> token ids in worker processes, never on the proxy's event loop.

The event loop answers clients and runs the watchdog; tokenizing a 1 MB prompt holds the GIL for most
of a second (the tokenizers library does not release it), so 16 of them at once held the loop for
4-7 s and the watchdog declared a healthy rank frozen. Here each prompt is encoded (and a chat
rendered first) by one of ``--text-workers`` spawned processes that load the model's tokenizer once,
and each client (its address, and whether it showed the API key) may have at most
``--text-jobs-per-client`` prompts there at once (default: the served concurrency, at least 2, so a client may
fill every slot): one more is refused with 429 at once, so one client's burst waits on its own share, not on
everyone's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import signal
from concurrent.futures.process import BrokenProcessPool

_TEXT = None  # the worker's ModelText


MIN_PER_CLIENT = 2  # the per-client limit's least default (a service of one slot still takes a second prompt)


class ClientBusy(Exception):
    """This client already has its share of prompts in the workers: 429 with Retry-After."""


class TextFailed(Exception):
    """The prompt cannot be turned into tokens; ``field`` and the message say why (400)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def _worker_start(model_dir: str, served_model_name: str | None, template_file: str | None) -> None:
    from engine.service.proxy_ranks import die_with_parent
    from engine.service.proxy_text import load_model_text

    die_with_parent()  # a SIGKILLed proxy leaves no worker behind
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the proxy's to handle (it drains)
    global _TEXT
    _TEXT = load_model_text(model_dir, served_model_name, template_file)


def _encode(text: str) -> tuple[str, list[int] | str]:
    try:
        return "ok", _TEXT.encode_prompt(text)
    except ValueError as exc:
        return "encode", str(exc)


def _chat(messages: list[dict], tools: list[dict] | None, extra: dict | None) -> tuple[str, tuple | str]:
    """The chat template (sandboxed, engine.core.chat_template) renders the prompt here, then it is encoded;
    the prompt text comes back too (whether it opens a reasoning block decides how the answer is parsed)."""
    try:
        prompt = _TEXT.render_chat(messages, tools=tools, extra=extra)
    except ValueError as exc:
        return "render", str(exc)
    kind, ids = _encode(prompt)
    return (kind, (prompt, ids)) if kind == "ok" else (kind, ids)


def _ready() -> int:
    return os.getpid()


class TextPool:
    def __init__(self, model_dir: str, served_model_name: str | None, workers: int, per_client: int | None,
                 template_file: str | None = None, concurrency=None):
        """``per_client`` None: the limit follows ``concurrency()`` (the served N once known; None before), at least
        MIN_PER_CLIENT."""
        self._args = (model_dir, served_model_name, template_file)
        self.workers, self._per_client, self._concurrency = workers, per_client, concurrency
        self._in_flight: dict[tuple, int] = {}
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"),  # never fork a threaded proxy
                initializer=_worker_start, initargs=self._args)
        return self._pool

    async def start(self) -> list[int]:
        """Start every worker now (each loads the tokenizer), so the first prompts do not wait for it."""
        loop = asyncio.get_running_loop()
        pool = self._executor()
        return list(await asyncio.gather(*(loop.run_in_executor(pool, _ready) for _ in range(self.workers))))

    async def encode(self, client: tuple, text: str, field: str = "prompt") -> list[int]:
        return self._answer(await self._run(client, _encode, text), field)

    async def chat(self, client: tuple, messages: list[dict], tools: list[dict] | None = None,
                   extra: dict | None = None) -> tuple[str, list[int]]:
        """(prompt text, its token ids) for a chat request."""
        return self._answer(await self._run(client, _chat, messages, tools, extra), "messages")

    @property
    def per_client(self) -> int:
        if self._per_client is not None:
            return self._per_client
        return max(MIN_PER_CLIENT, (self._concurrency() if self._concurrency else None) or 0)

    async def _run(self, client: tuple, fn, *args):
        held, limit = self._in_flight.get(client, 0), self.per_client
        if held >= limit:
            why = "" if self._per_client is not None else ": the served concurrency, at least 2"
            raise ClientBusy(f"this client already has {held} prompts being tokenized (--text-jobs-per-client "
                             f"{limit}{why}); send the next when one is answered")
        self._in_flight[client] = held + 1
        try:
            for attempt in (0, 1):
                try:
                    return await asyncio.get_running_loop().run_in_executor(self._executor(), fn, *args)
                except BrokenProcessPool:  # a worker died (killed, out of memory): a new pool, once
                    self._discard()
                    if attempt:
                        raise
        finally:
            left = self._in_flight[client] - 1
            if left:
                self._in_flight[client] = left
            else:
                del self._in_flight[client]

    @staticmethod
    def _answer(result: tuple[str, object], field: str):
        kind, value = result
        if kind == "ok":
            return value  # type: ignore[return-value]
        if kind == "render":
            raise TextFailed(f"cannot build a chat prompt for this model: {value}", "messages")
        raise TextFailed(f"{field}: {value}", field)

    def _discard(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:  # a worker in the middle of a long prompt is not waited for
            if proc.is_alive():
                proc.kill()
