"""deploykit's bundled CPU inference engine: native decoder models, paged KV cache, continuous batching.

Importing `engine` must not import torch: the engine process binds OpenMP threads and memory (engine.binding)
before torch loads its OpenMP runtime. Public names are resolved lazily.
"""

_EXPORTS = {"Engine": "engine.engine", "EngineConfig": "engine.config",
            "SamplingParams": "engine.params", "EngineError": "engine.errors", "ModelLoadError": "engine.errors",
            "RequestError": "engine.errors"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
