"""A cgroup a test creates as root to confine a process (cpuset and/or CFS quota), on cgroup v2 or v1, and removes
afterwards. Processes enter it through `wrap(cmd)`: a shell writes its own pid into the group, then execs `cmd`.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path("/sys/fs/cgroup")


class Cgroup:
    def __init__(self, cpus: str | None = None, quota: float | None = None, mems: str = "0"):
        if os.geteuid() != 0:
            pytest.skip("creating a cgroup needs root")
        name = f"deploykit-doctor-test-{uuid.uuid4().hex[:8]}"
        self.dirs: list[Path] = []
        if (ROOT / "cgroup.controllers").exists():
            d = ROOT / name
            wanted = [c for c, v in (("cpuset", cpus), ("cpu", quota)) if v is not None]
            (ROOT / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))
            d.mkdir()
            self.dirs.append(d)
            if cpus is not None:
                (d / "cpuset.cpus").write_text(cpus)
                (d / "cpuset.mems").write_text(mems)
            if quota is not None:
                (d / "cpu.max").write_text(f"{int(quota * 100000)} 100000")
        else:
            if cpus is not None:
                d = ROOT / "cpuset" / name
                d.mkdir()
                self.dirs.append(d)
                (d / "cpuset.cpus").write_text(cpus)
                (d / "cpuset.mems").write_text(mems)
            if quota is not None:
                mount = next(ROOT / m for m in ("cpu,cpuacct", "cpu") if (ROOT / m / "cpu.cfs_quota_us").exists())
                d = mount / name
                d.mkdir()
                self.dirs.append(d)
                (d / "cpu.cfs_period_us").write_text("100000")
                (d / "cpu.cfs_quota_us").write_text(str(int(quota * 100000)))

    def wrap(self, cmd: list[str]) -> list[str]:
        joins = "; ".join(f"echo $$ > {d}/cgroup.procs" for d in self.dirs)
        return ["sh", "-c", f'{joins}; exec "$@"', "sh", *cmd]

    def close(self) -> None:
        for d in self.dirs:
            for _ in range(50):  # the processes were killed; the kernel empties the group shortly after
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
