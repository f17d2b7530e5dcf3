"""Exceptions the engine raises to its callers (bad model directory, bad request)."""


class EngineError(Exception):
    """Base class: anything the engine reports to a user as a clear, actionable message."""


class ModelLoadError(EngineError):
    """The model directory cannot be served: missing/invalid config.json, missing weights, unsupported shape."""


class RequestError(EngineError, ValueError):
    """A request the engine cannot accept (empty prompt, longer than the context window, bad token id)."""
