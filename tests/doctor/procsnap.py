"""Recorded /proc snapshots of a process tree, for doctor's fixture tests of servers CI cannot run (vLLM's CPU backend).

`record(pid, seconds, dest)` reads the tree's /proc files twice, `seconds` apart, keeping only what
deploykit.process reads (status lines, stat, schedstat, cmdline, the mapped files' paths, pages per node, the
OpenMP/allocator environment: never the rest of an environment), plus a topology snapshot of the host, into one
deterministic .tar.gz. `load(archive)` gives back the Sample and the Topology doctor judges.

    python -m tests.doctor.procsnap PID OUT.tar.gz [SECONDS]
"""

from __future__ import annotations

import json
import re
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from deploykit import hostsettings, process, procfs, snapshot, topology
from deploykit.process import Sample

_STATUS = re.compile(r"^(Name|Uid|Seccomp|CapEff|Cpus_allowed_list|Mems_allowed_list):")
_PAGES = re.compile(r"\bN\d+=")


def _trimmed(base: Path, prefix: str) -> dict[str, str]:
    out: dict[str, str] = {}

    def put(name: str, text: str) -> None:
        out[f"{prefix}/{name}"] = text

    def read(name: str) -> str | None:
        try:
            return (base / name).read_text(errors="replace")
        except OSError:
            return None

    status = read("status")
    stat = read("stat")
    if status is None or stat is None:
        return {}
    put("status", "".join(line + "\n" for line in status.splitlines() if _STATUS.match(line)))
    put("stat", stat)
    cmdline = read("cmdline")
    if cmdline is not None:
        put("cmdline", cmdline)
    try:
        env = hostsettings.parse_environ((base / "environ").read_bytes())
        put("environ", "".join(f"{k}={v}\0" for k, v in sorted(env.items())))
    except OSError:
        pass
    maps = read("maps")
    if maps is not None:
        put("maps", "".join(f"00000000-00001000 r-xp 00000000 00:00 0 {p}\n" for p in procfs.mapped_files(maps)))
    numa = read("numa_maps")
    if numa is not None:
        put("numa_maps", "".join(line + "\n" for line in numa.splitlines() if _PAGES.search(line)))
    for tid in sorted((base / "task").iterdir(), key=lambda p: int(p.name)) if (base / "task").is_dir() else ():
        t_status, t_stat = read(f"task/{tid.name}/status"), read(f"task/{tid.name}/stat")
        if t_status is None or t_stat is None:
            continue
        put(f"task/{tid.name}/status", "".join(line + "\n" for line in t_status.splitlines()
                                               if _STATUS.match(line)))
        put(f"task/{tid.name}/stat", t_stat)
        sched = read(f"task/{tid.name}/schedstat")
        if sched is not None:
            put(f"task/{tid.name}/schedstat", sched)
    return out


def record(pid: int, seconds: float, dest: Path, note: str = "") -> Path:
    pids = process.tree(pid)
    files: dict[str, str] = {}
    for p in pids:
        files.update(_trimmed(Path("/proc") / str(p), f"before/{p}"))
    t0 = time.monotonic()
    time.sleep(seconds)  # the sampling window itself
    for p in pids:
        files.update(_trimmed(Path("/proc") / str(p), f"after/{p}"))
    took = time.monotonic() - t0
    for rel, text in snapshot.collect("/").items():
        files[f"sysroot/{rel}"] = text
    files["meta.json"] = json.dumps({"pid": pid, "pids": pids, "seconds": round(took, 3), "note": note},
                                    indent=2, sort_keys=True) + "\n"
    snapshot.write_archive(dest, files)
    return dest


def load(archive: Path, tmp: Path) -> tuple[Sample, topology.Topology, dict]:
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    meta = json.loads((tmp / "meta.json").read_text())
    before = {p: process.read(p, tmp / "before") for p in meta["pids"] if (tmp / "before" / str(p)).is_dir()}
    after = {p: process.read(p, tmp / "after") for p in before if (tmp / "after" / str(p)).is_dir()}
    topo = topology.read(tmp / "sysroot")
    return Sample(before, after, meta["seconds"]), topo, meta


if __name__ == "__main__":
    out = record(int(sys.argv[1]), float(sys.argv[3]) if len(sys.argv) > 3 else 3.0, Path(sys.argv[2]),
                 note=" ".join(sys.argv[4:]))
    print(out)
    with tempfile.TemporaryDirectory() as d:
        s, t, _ = load(out, Path(d))
        print(f"{len(s.after)} processes, {sum(len(p.threads) for p in s.after.values())} threads")
