"""The model's layer kinds as classes (one file per kind, engine.model.registry maps the config's layer types to
them); engine.core.model.Model holds a list of them and loops over it."""
