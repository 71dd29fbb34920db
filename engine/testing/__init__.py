"""Test and benchmark helpers: `engine.testing.make_model` builds seeded model folders.

Nothing is re-exported here on purpose: importing `make_model` from the package would load torch and
transformers on `import engine.testing`, and make `python -m engine.testing.make_model` warn that the
module was imported before it ran.
"""
