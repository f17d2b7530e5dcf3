"""The sweep's candidates come from the planner: every strategy, SMT on and off, equal splits of each NUMA node,
each planned for real, duplicates merged and refusals explained."""
from __future__ import annotations

import yaml

from deploykit import hardware, specfile
from deploykit.bench.candidates import candidates, strategies
from tests.conftest import QWEN3_8B

QWEN2_05B = {"num_parameters": 494_032_768, "num_hidden_layers": 24, "num_key_value_heads": 2, "head_dim": 64,
             "max_position_embeddings": 32768}


def spec(tmp_path, sysroot, arch=QWEN2_05B, **placement) -> str:
    data = {"apiVersion": "deploykit/v1", "kind": "Deployment", "name": "qwen",
            "model": {"source": "Qwen/Qwen2.5-0.5B", "max_model_len": 4096, "architecture": arch},
            "hardware": {"sysroot": str(sysroot)}, **({"placement": placement} if placement else {})}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def found(path):
    return candidates(path, hardware.resolve(specfile.load(path), None))


def test_a_two_cpu_host_offers_one_replica_of_two_threads_and_two_of_one(tmp_path, sysroots):
    cands, notes = found(spec(tmp_path, sysroots["two-cpu"]))
    assert [(c.shape(), c.cpus()) for c in cands] == [("1 replica x 2 threads", "0-1"),
                                                      ("2 replicas x 1 thread", "0 | 1")]
    # every strategy but explicit plans to the same single replica: one candidate, named after all of them
    assert cands[0].label == " = ".join(strategies())
    assert cands[1].placement == {"strategy": "explicit", "cpus": ["0", "1"]}
    assert all(not r.frontend_cpus for c in cands for r in c.plan.replicas)  # < 4 cores: nothing reserved
    assert notes == []


def test_placements_the_planner_refuses_are_dropped_with_its_reason(tmp_path, sysroots):
    # 16 GB of bf16 weights fit the 24 GiB node once, not in two halves
    cands, notes = found(spec(tmp_path, sysroots["two-cpu"], QWEN3_8B))
    assert [c.shape() for c in cands] == ["1 replica x 2 threads"]
    assert len(notes) == 1 and notes[0].startswith("2 per NUMA node: not tried, the planner refuses it here: replica")
    assert "cannot hold the model" in notes[0]


def test_a_two_socket_smt_host_varies_strategy_smt_and_splits_and_every_candidate_plans(tmp_path, sysroots):
    path = spec(tmp_path, sysroots["epyc-2s-nps1"], reserved_cpus=1, threads=8)
    cands, notes = found(path)
    layouts = {c.layout for c in cands}
    assert len(layouts) == len(cands)  # no two candidates run the same CPUs
    labels = [c.label for c in cands]
    assert "per-numa-node = per-socket" in labels and "single" in labels
    assert "per-numa-node (SMT) = per-socket (SMT)" in labels
    assert {"2 per NUMA node", "32 per NUMA node", "4 per NUMA node (SMT)"} <= set(labels)
    by = {c.label: c for c in cands}
    assert by["per-numa-node = per-socket"].shape() == "2 replicas x 95 threads"  # one core per replica reserved
    assert by["per-numa-node (SMT) = per-socket (SMT)"].shape() == "2 replicas x 190 threads"
    assert len(by["32 per NUMA node"].plan.replicas) == 64
    for c in cands:  # the user's reserved_cpus is kept, threads (which the splits vary) is not
        assert c.placement["reserved_cpus"] == 1 and "threads" not in c.placement
        specfile.from_data({**yaml.safe_load(open(path)), "placement": c.placement})
    assert notes == []
