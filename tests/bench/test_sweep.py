"""`deploykit bench SPEC --sweep` on this host: every placement the planner makes here (on 2 CPUs: one replica of
two threads, and two replicas of one thread) brought up with the local runtime, measured with real numbers, torn
down; the best is marked and written as a spec that validates and plans."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.runtime.helpers import deploykit

pytestmark = pytest.mark.slow


def test_sweep_measures_each_placement_and_writes_the_best(tmp_path, tiny_model):
    import os
    if len(os.sched_getaffinity(0)) != 2:
        pytest.skip("written for a 2-CPU host (the CI machine): one replica x 2 threads vs two replicas x 1 thread")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"apiVersion": "deploykit/v1", "kind": "Deployment", "name": "swept",
                                    "model": {"source": str(tiny_model), "max_model_len": 256},
                                    "serving": {"port": 8000, "kv_cache": "16MiB", "max_num_seqs": 4}}))
    env = {"DEPLOYKIT_STATE_DIR": str(tmp_path / "state"), "DEPLOYKIT_LOCAL_LB": "builtin"}
    r = deploykit("bench", spec, "--sweep", "--concurrency", "1,2", "--requests", "4", "--max-tokens", "8",
                  "--prompt-tokens", "16", "--no-progress", "--write-spec", tmp_path / "best.yaml",
                  "--out", tmp_path / "sweep.json", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "sweep.json").read_text())
    shapes = {c["shape"]: c for c in doc["candidates"]}
    assert set(shapes) == {"1 replica x 2 threads", "2 replicas x 1 thread"}
    for c in shapes.values():
        assert c["status"] == "measured" and c["score"] > 0
        for lv in c["result"]["levels"]:
            assert lv["errors"] == 0 and lv["output_tokens"] == 4 * 8 and lv["output_tokens_per_s"] > 0
            assert lv["ttft_s"]["p99"] > 0
    # the two-replica candidate was measured through its load balancer, with both replicas' metrics
    two = shapes["2 replicas x 1 thread"]["result"]
    assert set(two["levels"][0]["replica_metrics"]) == {"swept-sweep-0", "swept-sweep-1"}
    best = max(doc["candidates"], key=lambda c: c["score"])
    assert doc["best"] == best["label"]
    assert "★ best" in r.stdout and best["label"].split(" = ")[0] in r.stdout
    written = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert written["placement"] == best["placement"] and written["name"] == "swept"
    assert written["serving"]["port"] == 8000  # the user's serving section, not the sweep's loopback ports
    for command in ("validate", "plan"):
        assert deploykit(command, tmp_path / "best.yaml").returncode == 0
    assert not (tmp_path / "state" / "swept-sweep").exists()  # every candidate was torn down
