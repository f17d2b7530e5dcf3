"""oneMKL VML's first-call race (engine/vml.py): every ATen function routed to VML is resolved before the engine's
first parallel call, so a process's rotary tables, and so its logits, are the same bits in every process."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from engine import vml

ROOT = Path(__file__).resolve().parents[2]

# A fresh process the way the server starts one: the OpenMP pool running (engine.binding.finish's warm-up matmul),
# its threads spinning, then the engine's start-up and the model's rotary tables.
CHILD = """
import torch
x = torch.ones(256, 256)
for _ in range(3):
    x = x @ x * 0.0
from engine import vml
from engine.models.layers import Rotary, rope_inv_freq
vml.resolve()
r = Rotary(64, 100000.0, None, 4096, torch.float32)
freqs = torch.arange(4096, dtype=torch.float32)[:, None] * rope_inv_freq(64, 100000.0, None)
print(max((r.cos[:, :32].double() - freqs.double().cos()).abs().max().item(),
          (r.sin[:, 32:].double() - freqs.double().sin()).abs().max().item()))
"""


def test_every_function_aten_routes_to_vml_is_resolved():
    header = Path(torch.__file__).parent / "include" / "ATen" / "cpu" / "vml.h"
    routed = set(re.findall(r"^IMPLEMENT_VML_MKL\((\w+),", header.read_text(), re.MULTILINE))
    assert routed and routed <= set(vml.FUNCTIONS), f"torch routes {sorted(routed - set(vml.FUNCTIONS))} to VML too"


def test_rotary_tables_are_accurate_in_every_fresh_process():
    """Without the warm-up about 1 process in 5-10 got one thread's half of the cos table 1.5e-4 off here (the
    correct tables are within 1e-7 of fp64); eight starts catch that most of the time."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE", "PYTHONPATH": str(ROOT)}
    errors = []
    for _ in range(8):
        out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                             check=False)
        assert out.returncode == 0, out.stderr
        errors.append(float(out.stdout.split()[-1]))
    assert max(errors) < 1e-6, errors


def test_resolve_runs_once_per_process():
    vml.resolve()
    assert vml.resolve() is False
