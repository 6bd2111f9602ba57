"""engine.kernels: the decode and prefill Triton kernels by family, each a ``*_jit`` module of module-level kernels
beside its launches and the plain torch reference its tests use (docs/engine.md, the layout); the bottom floor of
the engine: it imports nothing above it (engine/kernels/ruff.toml)."""
