"""`deploykit topology snapshot DIR`: copy exactly the files the topology reader uses, so a plan can be made
elsewhere with `--sysroot DIR` (like `lscpu --sysroot`)."""

from __future__ import annotations

import gzip
import io
import json
import re
import tarfile
from pathlib import Path

from . import hostsettings
from .errors import OutputError
from .topology import read_with_sources

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_STATUS_KEYS = re.compile(r"^(Cpus_allowed|Cpus_allowed_list|Mems_allowed|Mems_allowed_list|"
                          + "|".join(hostsettings.STATUS_KEYS) + "):", re.M)


def take(dest: str | Path, sysroot: str | Path = "/", force: bool = False) -> list[str]:
    """Write the snapshot into `dest` (must be absent or empty unless force). Returns the relative paths written.

    Three files are trimmed to what the readers need: /proc/cpuinfo keeps its first processor block (model name
    and flags; CPU ids come from /sys), /proc/self/status the allowed CPUs/nodes, seccomp and capability lines, and
    /proc/self/environ only the OpenMP, allocator and preload variables (never keys or tokens). A live snapshot also
    records the NUMA-call and AMX probes (hostsettings.PROBE_FILE), which cannot be run on a snapshot later.
    """
    dest = Path(dest)
    archive = dest.name.endswith(ARCHIVE_SUFFIXES)
    if dest.exists() and (archive or not dest.is_dir() or any(dest.iterdir())) and not force:
        raise OutputError("output already exists" + ("" if archive else " and is not an empty directory"),
                          path=str(dest), hint="choose a new path, or pass --force to overwrite")
    files = collect(sysroot)
    try:
        if archive:
            write_archive(dest, files)
        else:
            for rel, text in files.items():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                (dest / rel).write_text(text)
    except OSError as e:
        raise OutputError(f"cannot write snapshot: {e}", path=str(dest)) from None
    return sorted(files)


def collect(sysroot: str | Path = "/") -> dict[str, str]:
    """{relative path: content} of every file the topology reader uses, trimmed as described in take()."""
    _, sources = read_with_sources(sysroot)
    settings, more = hostsettings.read_with_sources(sysroot)
    root = Path(sysroot)
    out = {}
    for rel in sorted(set(sources) | set(more)):
        if rel == "proc/self/environ":
            env = hostsettings.parse_environ((root / rel).read_bytes())
            if env or settings.live:  # live: an empty record still says "no such variable was set"
                out[rel] = "".join(f"{k}={v}\0" for k, v in sorted(env.items()))
            continue
        if rel == hostsettings.PROBE_FILE and settings.live:
            continue
        text = (root / rel).read_text(errors="replace")
        if rel == "proc/cpuinfo":
            text = text.split("\n\n", 1)[0].rstrip("\n") + "\n"
        elif rel == "proc/self/status":
            text = "".join(line + "\n" for line in text.splitlines() if _STATUS_KEYS.match(line))
        out[rel] = text
    if settings.live and settings.probe is not None:
        out[hostsettings.PROBE_FILE] = json.dumps(settings.probe.to_dict(), indent=2, sort_keys=True) + "\n"
    return out


def write_archive(dest: Path, files: dict[str, str]) -> None:
    """Deterministic tar.gz: sorted entries, zero mtimes/owners, so the same machine gives the same bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted(files):
            data = files[rel].encode()
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    if dest.name.endswith(".tar"):
        dest.write_bytes(raw)
    else:
        dest.write_bytes(gzip.compress(raw, mtime=0))
