from tests.engine.conftest import model_paths  # noqa: F401 — the engine tests' tiny checkpoints, reused
