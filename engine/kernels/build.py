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
           "decode_attention.cpp")
HEADERS = ("vec.h",)
LIBRARY_NAME = "deploykit_kernels.so"
MANIFEST_NAME = "manifest.json"
SOURCE_DIR = Path(__file__).resolve().parent

# No -march: the image is built on one host and may run on another. The loader only dlopens
# the library after /proc/cpuinfo shows avx512_bf16, and AMX code runs only with amx_* flags.
ISA_FLAGS = (
    "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma",
    "-mamx-tile", "-mamx-bf16",
)
# -fopenmp only at compile time (at::parallel_for's pragma); at link time the library is tied to
# torch's own libgomp so the process never holds two OpenMP runtimes.
CXX_FLAGS = ("-O3", "-std=c++20", "-fPIC", "-fopenmp", "-DNDEBUG", "-Wall", "-Wno-unused-function") + ISA_FLAGS


@dataclass(frozen=True, slots=True)
class BuildResult:
    directory: Path
    library: Path
    seconds: float


def source_hash() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((SOURCE_DIR / name).read_bytes())
    h.update(" ".join(CXX_FLAGS).encode())
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


def _compile_commands(cxx: str, obj_dir: Path) -> list[list[str]]:
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    return [
        [cxx, *CXX_FLAGS, abi_flag(), *includes, "-c", str(SOURCE_DIR / src), "-o", str(obj_dir / f"{src}.o")]
        for src in SOURCES
    ]


def _link_command(cxx: str, obj_dir: Path, out: Path) -> list[str]:
    lib_dirs = cpp_extension.library_paths()
    return [
        cxx, "-shared", *(str(obj_dir / f"{src}.o") for src in SOURCES), "-o", str(out),
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
    """Compile into `directory` (default: default_dir()); a no-op when an up-to-date build is there."""
    directory = Path(directory) if directory is not None else default_dir()
    library = directory / LIBRARY_NAME
    if not force and manifest_matches(directory):
        return BuildResult(directory, library, 0.0)
    directory.mkdir(parents=True, exist_ok=True)
    cxx = compiler()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        obj_dir = Path(tmp)
        _run_all(_compile_commands(cxx, obj_dir))
        staged = obj_dir / LIBRARY_NAME
        _run_all([_link_command(cxx, obj_dir, staged)])
        os.replace(staged, library)  # atomic: a concurrent loader sees the old or the new library
    seconds = time.perf_counter() - start
    manifest = {
        "torch": torch.__version__,
        "source_hash": source_hash(),
        "flags": list(CXX_FLAGS),
        "compiler": cxx,
        "python": sys.version.split()[0],
        "build_seconds": round(seconds, 2),
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return BuildResult(directory, library, seconds)


def manifest_matches(directory: Path) -> bool:
    """True when `directory` holds a library built from these sources for this torch."""
    try:
        manifest = json.loads((Path(directory) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (
        (Path(directory) / LIBRARY_NAME).is_file()
        and manifest.get("torch") == torch.__version__
        and manifest.get("source_hash") == source_hash()
    )
