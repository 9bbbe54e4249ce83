"""Engine tests run against one real llama-server (see ``tests._engine_fixture``)."""

from tests._engine_fixture import anyio_backend, engine

__all__ = ["anyio_backend", "engine"]
