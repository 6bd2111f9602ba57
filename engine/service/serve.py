"""`python -m engine serve`: the OpenAI-compatible service over two rank processes.

Stays in the foreground (a supervisor runs it); the ranks are its children and die
with it. SIGTERM and SIGINT (Ctrl-C) drain: no new request is taken (503), running and
queued ones may finish for --drain-timeout-s, what is left gets 503 (an SSE error event
and [DONE] on streams), then the ranks are stopped and serve exits 0; a second signal
exits at once. Exit codes: 0 after SIGTERM/SIGINT, 2 for a flag that cannot be used,
3 when the ranks failed to start --max-restarts + 1 times in a row, 4 when this host
cannot serve as asked (the serve extra missing, no CUDA for --device cuda, the port
taken, the state directory in use by another serve).

Everything it writes is private: umask 077, the state directory 0700, files 0600.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import resource
import signal
import socket
import sys
import threading

from engine.service.serve_config import (
    EXIT_BAD_INPUT,
    EXIT_CANNOT_SERVE,
    ServeConfigError,
    add_serve_arguments,
    config_from_args,
)
from engine.service.state_dir import ID_ENV, StateDirError, make_state_dir, service_id


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the service took over the signal: quiet
        return 0


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine serve", description=__doc__.splitlines()[0])
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ServeConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    os.umask(0o077)  # state files, logs and sockets: the user's only (ranks inherit it)
    try:
        make_state_dir(cfg.state_dir)  # not this user's, writable by others, or a link on the way: refused
        token = service_id(cfg.state_dir)
    except StateDirError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if os.environ.get(ID_ENV) != token:
        _carry_identity(token, argv)
    started = _claim(cfg)  # the state directory, then the fork server: its torch import overlaps all below
    if isinstance(started, int):
        return started
    lock, forks = started
    code: int | None = EXIT_CANNOT_SERVE  # until the checks pass (an exception or Ctrl-C leaves it so)
    try:
        # A fork server waiting for adoption is this state dir's, left by the proxy its supervisor just restarted:
        # that proxy checked this host's CUDA, so this one does not import torch to do it again (3-5 s of a GPU
        # host's proxy restart, measured on one H200: docs/acceptance.md, "kill_proxy on one H200").
        code = _cannot_serve(cfg, cuda_checked=forks is not None and forks.adopting)
    finally:
        if code is not None and forks is not None:
            forks.discard()  # not serving after all: the fork server must not wait for a proxy
    return code if code is not None else _run(cfg, lock, forks)


def _carry_identity(token: str, argv: list[str] | None) -> None:
    """Put the state directory's secret into this process's environment and its children's: run as
    `python -m engine serve` without it (by hand, by systemd), serve executes itself once more with it,
    so /proc/PID/environ (readable by this user and root only) proves the proxy is this service's
    (engine/service/state_dir.py). Called in-process (tests), it only sets it for the children."""
    os.environ[ID_ENV] = token
    own_command = argv is None or (sys.argv[1:2] == ["serve"] and list(argv) == sys.argv[2:])
    if own_command and len(sys.orig_argv) > 1:
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def _cannot_serve(cfg, cuda_checked: bool = False) -> int | None:
    """The exit code when this host cannot serve as asked (the serve extra missing, no CUDA), else None."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401  (checked before anything starts)
    except ImportError as exc:
        print(f"Error: the service needs the serve extra ({exc.name} is missing): pip install 'v100plan[serve]'",
              file=sys.stderr)
        return EXIT_CANNOT_SERVE
    problem = None if cuda_checked else cuda_problem(cfg.devices)
    if problem is not None:
        print(f"Error: {problem}\nHint: run on a host with NVIDIA GPUs and a CUDA build of torch, "
              f"or use --device cpu", file=sys.stderr)
        return EXIT_CANNOT_SERVE
    return None


def cuda_problem(devices: tuple[str, str]) -> str | None:
    """Why the ranks could not use these CUDA devices here, or None (checked once, in
    seconds, instead of failing every rank start until the restart cap)."""
    wanted = [d for d in devices if d.startswith("cuda")]
    if not wanted:
        return None
    try:
        import torch
    except ImportError:
        return f"--device {','.join(devices)}: torch is not installed (pip install 'v100plan[engine]')"
    if not torch.cuda.is_available():
        return f"--device {','.join(devices)}: CUDA is not available on this host (torch {torch.__version__})"
    count = torch.cuda.device_count()
    for d in wanted:
        index = int(d.split(":", 1)[1] or 0) if ":" in d else 0
        if index >= count:
            return f"--device {','.join(devices)}: {d} does not exist (this host has {count} CUDA device(s))"
    return None


def prepare_state_dir(state_dir: str):
    """Make the state directory private and take its lock (one serve per state directory).
    Returns the open lock file (kept for the life of the process) or raises OSError/RuntimeError."""
    make_state_dir(state_dir)  # StateDirError: not this user's, writable by others, or a link in it
    fd = os.open(os.path.join(state_dir, "serve.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    lock = os.fdopen(fd, "r+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = lock.read().strip()
        lock.close()
        raise RuntimeError(f"another serve (pid {holder or '?'}) uses the state directory {state_dir}; "
                           f"give this one its own --state-dir or --port") from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def listen_socket(host: str, port: int) -> socket.socket:
    """The listening socket handed to uvicorn. Created with proto=IPPROTO_TCP and TCP_NODELAY:
    asyncio turns Nagle off only on sockets whose proto says TCP, and socket.create_server leaves
    it 0, so without this a reused connection waits ~40 ms per response (Nagle meeting delayed
    ACKs). Accepted sockets inherit TCP_NODELAY on Linux."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def _raise_fd_limit(wanted: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return soft


def _claim(cfg):
    """Take the state directory (private, locked) and start the fork server: (lock, forks or None), or
    the exit code. First thing after the flags: the fork server's import of torch (seconds on a loaded
    CPU, more on a GPU host) runs while this process checks CUDA and imports its web stack, which is
    most of a proxy's restart after kill_proxy (docs/acceptance.md)."""
    from engine.service.proxy_ranks import die_with_parent, rank_env
    from engine.service.rank_forks import RankForks

    try:
        lock = prepare_state_dir(cfg.state_dir)
    except StateDirError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (OSError, RuntimeError) as exc:
        print(f"Error: state directory {cfg.state_dir}: {exc}", file=sys.stderr)
        return EXIT_CANNOT_SERVE
    forks = None
    if cfg.standby_ranks:
        os.makedirs(os.path.join(cfg.state_dir, "logs"), mode=0o700, exist_ok=True)
        adopt = os.path.join(cfg.state_dir, "forks.sock")  # a Unix socket path: at most 107 bytes
        forks = RankForks(os.path.join(cfg.state_dir, "logs", "rank-forks.log"), die_with_parent, rank_env(),
                          adopt_socket=adopt if len(adopt.encode()) < 100 else None,
                          gpu=cfg.gpu)
        forks.spawn_early()
    return lock, forks


def _run(cfg, lock, forks) -> int:
    from engine.service.proxy_log import StructuredLog
    log = StructuredLog(cfg.log_file)
    try:
        return _serve(cfg, log, lock, forks)
    except KeyboardInterrupt:  # Ctrl-C before uvicorn took the signal over: still one serve_exit line
        if forks is not None:
            forks.discard()
        log.emit("serve_exit", code=0, signal="SIGINT", reason="interrupted while starting")
        log.close()
        return 0


def _serve(cfg, log, lock, forks) -> int:
    import uvicorn

    from engine.service.app import create_app
    from engine.service.app_http import RateLimitFilter, guarded_h11_protocol
    from engine.service.control import register_control
    from engine.service.proxy_ranks import reap_stale_runs
    from engine.service.proxy_service import Service
    from engine.service.proxy_text import load_model_text

    reaped = reap_stale_runs(cfg.state_dir)
    if reaped:
        log.emit("reaped_stale_runs", count=len(reaped))
    text = load_model_text(cfg.model_dir, cfg.served_model_name, cfg.chat_template)
    exit_code = {"code": 0}
    server_box: dict = {}

    def on_exit(code: int) -> None:
        exit_code["code"] = code
        server = server_box.get("server")
        if server is not None:
            server.should_exit = True

    service = Service(cfg, log, on_exit, forks)
    app = create_app(service, text)
    if cfg.enable_fault_injection:
        register_control(app, service)
    # Descriptors: room for the connection cap plus the ranks' sockets, logs and the listener.
    fd_limit = _raise_fd_limit(cfg.max_connections + 256)
    max_connections = max(1, min(cfg.max_connections, fd_limit - 64))
    limiter = RateLimitFilter(10.0)
    for name in ("asyncio", "uvicorn.error"):
        logging.getLogger(name).addFilter(limiter)
    log.emit("serve_start", host=cfg.host, port=cfg.port, model=text.model_id, model_dir=cfg.model_dir,
             allreduce=cfg.allreduce, devices=list(cfg.devices), dtype=cfg.dtype, queue_cap=cfg.queue_cap,
             max_concurrency=cfg.max_concurrency, concurrency_bound=cfg.concurrency_bound,
             stall_timeout_s=cfg.stall_timeout_s, liveness_timeout_s=cfg.liveness_timeout_s,
             max_restarts=cfg.max_restarts, max_connections=max_connections,
             fault_injection=cfg.enable_fault_injection, api_key=cfg.api_key is not None)
    protocol = guarded_h11_protocol(max_connections, cfg.header_timeout_s, cfg.body_timeout_s,
                                    metrics=service.metrics, log=log, api_key=cfg.api_key)
    server = _DrainingServer(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                                            access_log=False, lifespan="on", timeout_graceful_shutdown=5,
                                            http=protocol, timeout_keep_alive=cfg.keep_alive_timeout_s,
                                            # the stdlib loop everywhere: rank children are forked from
                                            # this thread, which PR_SET_PDEATHSIG ties them to
                                            loop="asyncio"),
                             service=service, drain_timeout_s=cfg.drain_timeout_s, log=log)
    server_box["server"] = server
    # Bind before the lifespan starts the ranks: a taken port fails in milliseconds, not after
    # the ranks loaded their weights.
    try:
        sock = listen_socket(cfg.host, cfg.port)
    except OSError as exc:
        log.emit("serve_exit", code=EXIT_CANNOT_SERVE, reason=f"cannot bind {cfg.host}:{cfg.port}: {exc.strerror}")
        print(f"Error: cannot bind {cfg.host}:{cfg.port}: {exc.strerror}", file=sys.stderr)
        return EXIT_CANNOT_SERVE
    server.run(sockets=[sock])
    log.emit("serve_exit", code=exit_code["code"], signal=server.signal_name)
    log.close()
    lock.close()
    return exit_code["code"]


class _DrainingServer:
    """uvicorn's Server with our own SIGTERM/SIGINT handling: drain the service first, then let
    uvicorn close the connections, and exit normally (uvicorn re-raises a caught signal after
    its shutdown, which made serve die with 143 before logging serve_exit)."""

    def __new__(cls, config, service, drain_timeout_s: float, log):
        import uvicorn

        class Server(uvicorn.Server):
            signal_name: str | None = None

            @contextlib.contextmanager
            def capture_signals(self):
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                original = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for sig, handler in original.items():
                        signal.signal(sig, handler)

            def _on_signal(self, sig, frame) -> None:
                if self.signal_name is not None:  # a second signal: stop now
                    self.force_exit = True
                    self.should_exit = True
                    return
                self.signal_name = signal.Signals(sig).name
                loop = getattr(service, "loop", None)
                if loop is None or loop.is_closed():
                    self.should_exit = True
                    return
                loop.call_soon_threadsafe(lambda: loop.create_task(self._drain_then_exit()))

            async def _drain_then_exit(self) -> None:
                log.emit("signal", signal=self.signal_name, drain_timeout_s=drain_timeout_s)
                try:
                    await service.drain(drain_timeout_s)
                    await asyncio.sleep(0.2)  # streams write their error event and [DONE]
                finally:
                    self.should_exit = True

        return Server(config)


if __name__ == "__main__":
    sys.exit(main())
