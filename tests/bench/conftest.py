"""The runtime tests' tiny random-weight model, for the sweep."""
from tests.runtime.conftest import tiny_model  # noqa: F401 - a fixture, shared
