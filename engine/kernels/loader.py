"""Decides at import time whether the prebuilt native library can be used here, loads it, and records why not."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from deploykit import isa
from engine.kernels import build

BUILD_HINT = "run `python -m engine.kernels build` (at image build time)"


@dataclass(frozen=True, slots=True)
class Native:
    loaded: bool
    amx: bool
    isa: str  # deploykit.isa tier of this CPU
    reason: str
    library: str | None
    variant: str | None = None  # build.VARIANTS key of the loaded library

    @property
    def full(self) -> bool:
        """Every native op is here (an AVX-512 build); the AVX2 build holds the quantized-weight and fp32 ops only."""
        return self.loaded and self.variant in isa.FULL_VARIANTS


DISABLED = frozenset({"0", "off", "fallback", "torch"})  # DEPLOYKIT_KERNELS values that force PyTorch


variant_for = isa.kernel_variant  # the one home of the CPU -> build variant rule (doctor reports it too)


def load(flags: frozenset[str] | None = None) -> Native:
    """Load the library built by `python -m engine.kernels build`, or explain why the fallback is used.
    DEPLOYKIT_KERNELS=off forces the PyTorch path; =avx512 forces the widening build (to test it on a BF16 CPU);
    =avx2 the AVX2 build, quantized-weight and fp32 ops only (to test its int8 GEMV on an AVX-512 CPU)."""
    flags = isa.cpu_flags() if flags is None else flags
    tier = isa.tier(flags)
    choice = os.environ.get("DEPLOYKIT_KERNELS", "").lower()
    if choice in DISABLED:
        return Native(False, False, tier, "disabled by DEPLOYKIT_KERNELS", None)
    variant = variant_for(flags)
    if variant is None:
        return Native(False, False, tier, f"CPU lacks AVX2 (ISA tier {tier}); pure PyTorch path is the best "
                      "available", None)
    if choice == "avx512":
        variant = "avx512"
    elif choice == "avx2" and isa.AVX2_BASE <= flags:
        variant = "avx2"
    directory = build.default_dir()
    library = directory / build.library_name(variant)
    if not library.is_file():
        return Native(False, False, tier, f"no prebuilt kernel library at {library}; {BUILD_HINT}", None)
    if not build.manifest_matches(directory):
        return Native(False, False, tier, f"kernel library at {library} is stale (other sources or torch); {BUILD_HINT}", None)
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        return Native(False, False, tier, f"loading {library} failed: {exc}; {BUILD_HINT}", None)
    amx = variant == "avx512bf16" and {"amx_tile", "amx_bf16"} <= flags and bool(torch.ops.deploykit.amx_init())
    return Native(True, amx, tier, "", str(library), variant)
