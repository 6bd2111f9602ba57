"""The bundled two-GPU inference engine: what `v100plan deploy` ships to a GPU host.

Run it as `python -m engine <command>` (shard, make-demo-model, generate, rank,
serve, supervise, bench, bench-tp2). Depends on torch, safetensors and tokenizers;
never on typer, rich, fabric or v100plan.
"""
