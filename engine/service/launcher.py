"""`generate --tp 2`'s handle on the service's rank pair, for blocking code.

The ranks are started, spoken to and stopped exactly as the service does it
(engine.service.proxy_ranks: start_pair, RankPair.collect, RankPair.close), on an event
loop of this handle's own, with a private temporary state directory for sockets and logs.
Both ranks get the same request; the caller compares their tokens.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile

from engine.service.proxy_ranks import RankRequestError, RankStartError, start_pair
from engine.service.serve_config import ServeConfig


class LaunchError(RuntimeError):
    pass


def _settings(model: str, devices: list[str], dtype: str, allreduce: str, max_context: int,
              timeout_s: float, state_dir: str, kv_cache_dtype: str = "auto", draft_tokens: int = 0) -> ServeConfig:
    """The rank settings of a ServeConfig (the serving ones are unused here)."""
    return ServeConfig(model_dir=model, tp=2, host="127.0.0.1", port=0, api_key=None, allreduce=allreduce,
                       max_context=max_context, queue_cap=0, stall_timeout_s=timeout_s, max_restarts=0,
                       enable_fault_injection=False, devices=(devices[0], devices[1]), dtype=dtype,
                       state_dir=state_dir, served_model_name=None, body_limit_bytes=0, start_timeout_s=600.0,
                       allreduce_timeout_s=timeout_s, ping_interval_s=timeout_s, log_file=None,
                       standby_ranks=False, kv_cache_dtype=kv_cache_dtype, draft_tokens=draft_tokens)


class RankPair:
    def __init__(self, model: str, devices: list[str], dtype: str, allreduce: str, max_context: int,
                 timeout_s: float = 60.0, kv_cache_dtype: str = "auto", draft_tokens: int = 0):
        self._dir = tempfile.mkdtemp(prefix="v100plan-ranks-")
        self._loop = asyncio.new_event_loop()
        cfg = _settings(model, devices, dtype, allreduce, max_context, timeout_s, self._dir, kv_cache_dtype,
                        draft_tokens)
        try:
            self.pair = self._loop.run_until_complete(start_pair(cfg, 1))
        except RankStartError as e:
            self._loop.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise LaunchError(str(e)) from None
        self.ready = [link.ready for link in self.pair.links]

    def alive(self) -> bool:
        return not any(link.exited or link.eof for link in self.pair.links)

    def generate(self, msg: dict, timeout_s: float = 600.0) -> tuple[list[list[int]], list[dict]]:
        """Send ``msg`` to both ranks; returns (tokens per rank, done message per rank)."""
        try:
            return self._loop.run_until_complete(self.pair.collect(msg, timeout_s))
        except (RankRequestError, ConnectionError) as e:
            raise LaunchError(str(e)) from None

    def close(self) -> None:
        try:
            self._loop.run_until_complete(self.pair.close(grace_s=10.0))
        finally:
            self._loop.close()
            shutil.rmtree(self._dir, ignore_errors=True)
