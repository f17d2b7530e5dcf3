"""deploykit: declarative, NUMA-correct deployment of LLM inference on CPUs."""

__version__ = "0.1.0"
