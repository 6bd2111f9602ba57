"""`python -m engine COMMAND ...`: the bundle's entry point on a GPU host (or a CPU one).

Each command is a module with ``main(argv) -> exit code``; add a command by adding
one line to COMMANDS.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "shard": ("engine.core.shard", "split a checkpoint for tensor parallelism and verify it reassembles"),
    "make-demo-model": ("engine.core.demo_cli", "write the v100plan-demo model (byte-identical everywhere)"),
    "make-random-model": ("engine.core.random_cli", "a model of a config's shape whose weights are generated at load"),
    "generate": ("engine.service.generate", "one-shot generation, TP1 in-process or TP2 over two rank processes"),
    "rank": ("engine.service.rank_cli", "one tensor-parallel rank speaking the control-socket protocol"),
    "bench": ("engine.bench.decode", "decode and allreduce benchmark on a GPU host (prints JSON)"),
    "bench-tp2": ("engine.bench.tp2", "two GPUs: allreduce paths, the start-up race, TP2 vs TP1 decode (prints JSON)"),
    "serve": ("engine.service.serve", "the OpenAI-compatible service over two ranks"),
    "supervise": ("engine.service.supervise", "run the service under a real process supervisor"),
}


def usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: python -m engine COMMAND [options]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", "`python -m engine COMMAND --help` lists a command's options with their defaults.",
              "Exit codes: 0 done, 1 failed, 2 bad input, 4 device or dependency missing, 130 interrupted."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"Error: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
