"""One module per command family; each exposes ``register(app)``."""
