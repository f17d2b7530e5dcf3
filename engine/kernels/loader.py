"""Decides at import time whether the prebuilt native library can be used here, loads it, and records why not."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kernels import build

BUILD_HINT = "run `python -m engine.kernels build` (at image build time)"


@dataclass(frozen=True, slots=True)
class Native:
    loaded: bool
    amx: bool
    isa: str
    reason: str
    library: str | None
    variant: str | None = None  # build.VARIANTS key of the loaded library


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    # The image may run on another host than it was built on: read this host's flags.
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _isa(flags: frozenset[str]) -> str:
    if {"amx_tile", "amx_bf16"} <= flags:
        return "avx512_bf16+amx_bf16"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    if "avx512f" in flags:
        return "avx512 (no bf16)"
    return "no avx512"


AVX512_BASE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
DISABLED = frozenset({"0", "off", "fallback", "torch"})  # DEPLOYKIT_KERNELS values that force PyTorch


def variant_for(flags: frozenset[str]) -> str | None:
    """The build variant this CPU can run: vdpbf16ps where the CPU reports avx512_bf16, the widening build on
    any other AVX-512 (F, BW, VL, DQ) CPU, none below that."""
    if not AVX512_BASE <= flags:
        return None
    return "avx512bf16" if "avx512_bf16" in flags else "avx512"


def load(flags: frozenset[str] | None = None) -> Native:
    """Load the library built by `python -m engine.kernels build`, or explain why the fallback is used.
    DEPLOYKIT_KERNELS=off forces the PyTorch path; =avx512 forces the widening build (to test it on a BF16 CPU)."""
    flags = cpu_flags() if flags is None else flags
    isa = _isa(flags)
    choice = os.environ.get("DEPLOYKIT_KERNELS", "").lower()
    if choice in DISABLED:
        return Native(False, False, isa, "disabled by DEPLOYKIT_KERNELS", None)
    variant = variant_for(flags)
    if variant is None:
        return Native(False, False, isa, f"CPU lacks AVX-512 ({isa}); pure PyTorch path is the best available", None)
    if choice == "avx512":
        variant = "avx512"
    directory = build.default_dir()
    library = directory / build.library_name(variant)
    if not library.is_file():
        return Native(False, False, isa, f"no prebuilt kernel library at {library}; {BUILD_HINT}", None)
    if not build.manifest_matches(directory):
        return Native(False, False, isa, f"kernel library at {library} is stale (other sources or torch); {BUILD_HINT}", None)
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        return Native(False, False, isa, f"loading {library} failed: {exc}; {BUILD_HINT}", None)
    amx = variant == "avx512bf16" and {"amx_tile", "amx_bf16"} <= flags and bool(torch.ops.deploykit.amx_init())
    return Native(True, amx, isa, "", str(library), variant)
