"""Benchmark: `deploykit plan` on the 384-CPU 2x EPYC fixture, as a fresh process (what a user waits for).

Prints JSON. Target: well under 0.5 s wall, and torch never imported. Baseline measured in the same run:
a bare `python -c pass`, so interpreter start-up on this machine is visible separately.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.sysroots import MACHINES, write  # noqa: E402

SPEC = """apiVersion: deploykit/v1
kind: Deployment
name: bench
model: {source: Qwen/Qwen3-8B, max_model_len: 32768,
        architecture: {num_parameters: 8190735360, num_hidden_layers: 36, num_key_value_heads: 8, head_dim: 128}}
"""


def wall(cmd: list[str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        out.append(time.perf_counter() - t)
    return out


def main(runs: int = 10) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sysroot = write(MACHINES["epyc-2s-nps4"], Path(tmp) / "sysroot")
        spec = Path(tmp) / "spec.yaml"
        spec.write_text(SPEC)
        plan_cmd = [sys.executable, "-m", "deploykit.cli", "plan", str(spec), "--sysroot", str(sysroot),
                    "--format", "json"]
        check = subprocess.run([sys.executable, "-X", "importtime", *plan_cmd[1:]], capture_output=True, text=True,
                               check=True)
        torch_imported = any(line.split("|")[-1].strip().startswith("torch") for line in check.stderr.splitlines())
        base = wall([sys.executable, "-c", "pass"], runs)
        plan = wall(plan_cmd, runs)
    print(json.dumps({
        "benchmark": "plan_384_cpus_nps4",
        "runs": runs,
        "python_startup_s": round(statistics.median(base), 4),
        "plan_wall_s_median": round(statistics.median(plan), 4),
        "plan_wall_s_max": round(max(plan), 4),
        "plan_minus_startup_s": round(statistics.median(plan) - statistics.median(base), 4),
        "target_s": 0.5,
        "meets_target": statistics.median(plan) < 0.5,
        "torch_imported": torch_imported,
    }, indent=2))


if __name__ == "__main__":
    main()
