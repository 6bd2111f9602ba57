"""`python -m engine serve`: the OpenAI-compatible service over two rank processes.

Stays in the foreground (a supervisor runs it); the ranks are its children and die
with it. Exit codes: 0 after SIGTERM/SIGINT, 2 for a flag that cannot be used,
3 when the ranks failed to start --max-restarts + 1 times in a row.
"""

from __future__ import annotations

import argparse
import socket
import sys

from engine.serve_config import ServeConfigError, add_serve_arguments, config_from_args

EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine serve", description=__doc__.splitlines()[0])
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ServeConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401  (checked before anything starts)
    except ImportError as exc:
        print(f"Error: the service needs the serve extra ({exc.name} is missing): pip install 'v100plan[serve]'",
              file=sys.stderr)
        return 4
    return _run(cfg)


def _run(cfg) -> int:
    import uvicorn

    from engine.app import create_app
    from engine.control import register_control
    from engine.proxy_log import StructuredLog
    from engine.proxy_service import Service
    from engine.proxy_text import load_model_text

    log = StructuredLog(cfg.log_file)
    text = load_model_text(cfg.model_dir, cfg.served_model_name)
    exit_code = {"code": 0}
    server_box: dict = {}

    def on_exit(code: int) -> None:
        exit_code["code"] = code
        server = server_box.get("server")
        if server is not None:
            server.should_exit = True

    service = Service(cfg, log, on_exit)
    app = create_app(service, text)
    if cfg.enable_fault_injection:
        register_control(app, service)
    log.emit("serve_start", host=cfg.host, port=cfg.port, model=text.model_id, model_dir=cfg.model_dir,
             allreduce=cfg.allreduce, devices=list(cfg.devices), dtype=cfg.dtype, queue_cap=cfg.queue_cap,
             stall_timeout_s=cfg.stall_timeout_s, max_restarts=cfg.max_restarts,
             fault_injection=cfg.enable_fault_injection, api_key=cfg.api_key is not None)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                                           access_log=False, lifespan="on", timeout_graceful_shutdown=5,
                                           # the stdlib loop everywhere: rank children are forked from
                                           # this thread, which PR_SET_PDEATHSIG ties them to
                                           loop="asyncio"))
    server_box["server"] = server
    # Bind before the lifespan starts the ranks: a taken port fails in milliseconds, not after
    # the ranks loaded their weights.
    try:
        sock = socket.create_server((cfg.host, cfg.port), family=_family(cfg.host), reuse_port=False)
    except OSError as exc:
        log.emit("serve_exit", code=4, reason=f"cannot bind {cfg.host}:{cfg.port}: {exc.strerror}")
        print(f"Error: cannot bind {cfg.host}:{cfg.port}: {exc.strerror}", file=sys.stderr)
        return 4
    server.run(sockets=[sock])
    log.emit("serve_exit", code=exit_code["code"])
    log.close()
    return exit_code["code"]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


if __name__ == "__main__":
    sys.exit(main())
