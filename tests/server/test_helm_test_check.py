"""The chart's `helm test` check (charts/deploykit/files/placement_check.py) run for real against an engine started
the way a pod starts it: settings from DEPLOYKIT_* variables, `DEPLOYKIT_CPUS=auto`, no plan, no host CPU ids."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from deploykit.binding_report import BindingReport
from deploykit.render.helm import chart_dir
from tests.server.live import LiveServer, clean_env


def test_placement_check_passes_a_pod_style_engine_and_its_main_runs(tiny_model):
    env = clean_env(DEPLOYKIT_CPUS="auto", DEPLOYKIT_KV_CACHE="64MiB", DEPLOYKIT_MAX_MODEL_LEN="512",
                    DEPLOYKIT_SERVED_MODEL_NAME="tiny", DEPLOYKIT_USE_SMT="0")
    s = LiveServer(tiny_model, env=env)
    try:
        s.wait_ready()
        engine = BindingReport.from_dict(s.get("/debug/binding").json()).engine
        assert engine.source == "auto" and engine.physical_cores
        path = chart_dir() / "files" / "placement_check.py"
        spec = importlib.util.spec_from_file_location("placement_check", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        assert mod.check(engine, use_smt=False, reserved=None, threads=None) == []
        # What `helm test` runs: the Service for /v1/models, then every pod behind the headless Service's name.
        run_env = {**os.environ, "SERVICE": f"127.0.0.1:{s.port}", "PODS": "127.0.0.1", "PORT": str(s.port),
                   "MODEL": "tiny", "USE_SMT": "0", "RESERVED_CPUS": "", "THREADS": ""}
        done = subprocess.run([sys.executable, str(path)], env=run_env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.startswith("ok   pod 127.0.0.1: cpuset ")
        # The same check fails when the pod's threads do not match what the values promise (here: a cap of 1).
        done = subprocess.run([sys.executable, str(path)], env={**run_env, "THREADS": "1"},
                              capture_output=True, text=True, timeout=60)
        n = engine.omp_threads
        assert done.returncode == 1 and f"{n} OpenMP threads for" in done.stdout and "expected 1" in done.stdout
    finally:
        s.close()
