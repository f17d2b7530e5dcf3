"""The engine's one error family, and the exit code each member maps to in every `python -m engine ...` command."""

from __future__ import annotations


class EngineError(Exception):
    """Base class: anything the engine reports to a user as a clear, actionable message."""


class OptionsError(EngineError):
    """Bad command-line options or plan: a usage error, reported before any process starts."""


class ModelLoadError(EngineError):
    """The model cannot be served: missing/invalid config.json or GGUF header, missing weights, unsupported shape."""


class RequestError(EngineError):
    """A request the engine cannot accept. `param` names the offending parameter (OpenAI's error field) and
    `code` is a machine-readable reason such as "context_length_exceeded"; both travel as data, not in prose."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def __reduce__(self):  # pickles across the process boundary with its fields
        return _rebuild, (type(self), self.message, self.param, self.code)


def _rebuild(cls, message, param, code):
    return cls(message, param=param, code=code)


# Exit codes of every engine command (the server adds 1: the engine process died while serving).
EXIT_USAGE, EXIT_STARTUP = 2, 3
EXIT_CODES: dict[type[EngineError], int] = {OptionsError: EXIT_USAGE, ModelLoadError: EXIT_STARTUP,
                                            RequestError: EXIT_USAGE, EngineError: 1}


def exit_code(err: EngineError) -> int:
    for cls in type(err).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return 1
