"""The bundled two-GPU inference engine: what `v100plan deploy` ships to a GPU host.

Run it as `python -m engine <command>` (shard, make-demo-model, generate, rank,
serve, supervise, bench, bench-tp2). Depends on torch, safetensors and tokenizers;
never on typer, rich, fabric or v100plan.
"""

from pathlib import Path as _Path

# Where the package's data files live, and the directory that holds the package (what `-m engine` runs from).
DATA_DIR = _Path(__file__).resolve().parent / "data"
BUNDLE_ROOT = _Path(__file__).absolute().parent.parent
