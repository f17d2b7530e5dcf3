"""Ahead-of-time compilation of the native kernels into a cache directory keyed by torch version and source hash."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import cpp_extension

SOURCES = ("gemv_bf16.cpp", "amx_bf16.cpp", "amx_plain_bf16.cpp", "stream_read.cpp", "decode_ops.cpp",
           "decode_attention.cpp", "decode_step.cpp", "quant_pack.cpp", "qlinear.cpp", "argmax.cpp",
           "compact_bf16.cpp", "compact_amx.cpp", "f32_ops.cpp", "bf16w_linear.cpp", "prefill_attention.cpp",
           "quant_prompt_amx.cpp", "decode_step_f32.cpp", "step_profile.cpp", "runs_ops.cpp")
# The AVX2 build holds the quantized-weight ops, the fp32 ops and the roofline probe: a CPU without AVX-512 runs a
# model in fp32, keeps GGUF blocks quantized and reads them with the AVX2 int8 GEMV, keeps a bf16 checkpoint's
# matrices in bf16 and widens them in registers (bf16w_linear.cpp), and runs the rest of a decoder layer on
# f32_ops.cpp. Both of those files are AVX2 + FMA code that every build holds, as is the greedy argmax (argmax.h has
# both ISAs' code), which the fp32 step ends with.
AVX2_SOURCES = ("quant_pack.cpp", "qlinear.cpp", "stream_read.cpp", "f32_ops.cpp", "bf16w_linear.cpp",
                "decode_step_f32.cpp", "step_profile.cpp", "runs_ops.cpp", "argmax.cpp")
HEADERS = ("vec.h", "gemv.h", "row_ops.h", "attention.h", "op_args.h", "quant_layout.h", "quant_act.h", "quant_gemv.h",
           "quant_gemv_avx2.h", "quant_rows.h", "quant_stream.h", "quant_scale.h", "quant_amx.h", "step_profile.h",
           "compact_bf16.h", "compact_amx.h", "amx_tiles.h", "amx_slices.h", "paged_kv.h", "step_matrix.h",
           "step_layers.h", "step_f32_layers.h", "f32_rows.h", "bf16w_rows.h", "bf16w_blocked.h", "step_args.h", "runs.h",
           "argmax.h")
MANIFEST_NAME = "manifest.json"
SOURCE_DIR = Path(__file__).resolve().parent

# No -march: the image is built on one host and may run on another, so every variant is built and the
# loader picks the one this host's /proc/cpuinfo allows (AMX code runs only after amx_* flags and the OS
# grant). "avx512" serves AVX-512F CPUs without BF16 (vec.h widens bf16 by a shift); "avx2" the CPUs below AVX-512
# (deploykit.isa.kernel_variant).
# -fopenmp only at compile time (at::parallel_for's pragma); at link time the library is tied to
# torch's own libgomp so the process never holds two OpenMP runtimes.
COMMON_FLAGS = ("-O3", "-std=c++20", "-fPIC", "-fopenmp", "-DNDEBUG", "-Wall", "-Wno-unused-function")
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma")


@dataclass(frozen=True, slots=True)
class Variant:
    flags: tuple[str, ...]
    sources: tuple[str, ...]


VARIANTS = {
    "avx512bf16": Variant(AVX512_FLAGS + ("-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8"), SOURCES),
    "avx512": Variant(AVX512_FLAGS, SOURCES),
    "avx2": Variant(("-mavx2", "-mfma", "-mf16c"), AVX2_SOURCES),
}


def cxx_flags(variant: str) -> tuple[str, ...]:
    return COMMON_FLAGS + VARIANTS[variant].flags


def library_name(variant: str) -> str:
    return f"deploykit_kernels_{variant}.so"


@dataclass(frozen=True, slots=True)
class BuildResult:
    directory: Path
    seconds: float


def source_hash() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((SOURCE_DIR / name).read_bytes())
    for variant in VARIANTS:
        h.update(" ".join((variant,) + cxx_flags(variant) + VARIANTS[variant].sources).encode())
    return h.hexdigest()[:16]


def default_dir() -> Path:
    env = os.environ.get("DEPLOYKIT_KERNEL_DIR")
    if env:
        return Path(env).expanduser()
    version = torch.__version__.replace("+", "_")
    return Path.home() / ".cache" / "deploykit" / "kernels" / f"{version}-{source_hash()}"


def abi_flag() -> str:
    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"C++ compiler {cxx!r} not found; install g++ (Debian: apt-get install g++)")
    return cxx


def _compile_commands(cxx: str, variant: str, obj_dir: Path) -> list[list[str]]:
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    return [
        [cxx, *cxx_flags(variant), abi_flag(), *includes, "-c", str(SOURCE_DIR / src), "-o", str(obj_dir / f"{src}.o")]
        for src in VARIANTS[variant].sources
    ]


def _link_command(cxx: str, variant: str, obj_dir: Path, out: Path) -> list[str]:
    lib_dirs = cpp_extension.library_paths()
    return [
        cxx, "-shared", *(str(obj_dir / f"{src}.o") for src in VARIANTS[variant].sources), "-o", str(out),
        *(f"-L{d}" for d in lib_dirs), *(f"-Wl,-rpath,{d}" for d in lib_dirs),
        "-lc10", "-ltorch_cpu", "-ltorch", "-lgomp",
    ]


def _run_all(commands: list[list[str]]) -> None:
    # Sources compile independently; run them side by side.
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd in commands]
    failures = []
    for cmd, proc in zip(commands, procs):
        output, _ = proc.communicate()
        if proc.returncode != 0:
            failures.append(f"$ {' '.join(cmd)}\n{output}")
    if failures:
        raise RuntimeError("kernel compilation failed:\n" + "\n".join(failures))


def build(directory: Path | None = None, force: bool = False) -> BuildResult:
    """Compile every variant into `directory` (default: default_dir()); a no-op when an up-to-date build is
    there."""
    directory = Path(directory) if directory is not None else default_dir()
    if not force and manifest_matches(directory):
        return BuildResult(directory, 0.0)
    directory.mkdir(parents=True, exist_ok=True)
    cxx = compiler()
    start = time.perf_counter()
    for variant in VARIANTS:  # one variant at a time: six torch-header compiles at once is enough memory
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            obj_dir = Path(tmp)
            _run_all(_compile_commands(cxx, variant, obj_dir))
            staged = obj_dir / library_name(variant)
            _run_all([_link_command(cxx, variant, obj_dir, staged)])
            os.replace(staged, directory / library_name(variant))  # atomic for a concurrent loader
    seconds = time.perf_counter() - start
    manifest = {
        "torch": torch.__version__,
        "source_hash": source_hash(),
        "variants": {variant: list(cxx_flags(variant)) for variant in VARIANTS},
        "compiler": cxx,
        "python": sys.version.split()[0],
        "build_seconds": round(seconds, 2),
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return BuildResult(directory, seconds)


def manifest_matches(directory: Path) -> bool:
    """True when `directory` holds every variant built from these sources for this torch."""
    try:
        manifest = json.loads((Path(directory) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (
        all((Path(directory) / library_name(v)).is_file() for v in VARIANTS)
        and manifest.get("torch") == torch.__version__
        and manifest.get("source_hash") == source_hash()
    )
