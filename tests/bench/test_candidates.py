"""The sweep's candidates are the planner's own choices (planner.feasible) with SMT off and on, each planned for
real, written as a placement section that plans to the same replicas, duplicates merged and refusals explained."""
from __future__ import annotations

import pytest
import yaml

from deploykit import hardware, memory, planner, specfile
from deploykit.bench.candidates import candidates
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


def plans_the_same(path, c) -> bool:
    """The candidate's placement section, put in the user's spec, plans to the candidate's replicas."""
    variant = specfile.from_data({**yaml.safe_load(open(path)), "placement": c.placement})
    topo = hardware.resolve(variant, None)
    plan = planner.make_plan(variant, topo, memory.shape(variant.model))
    return tuple((r.cpus, r.frontend_cpus) for r in plan.replicas) == c.layout


@pytest.mark.slow
def test_a_two_cpu_host_offers_one_replica_of_two_threads_and_two_of_one(tmp_path, sysroots):
    path = spec(tmp_path, sysroots["two-cpu"])
    cands, notes = found(path)
    assert [(c.shape(), c.cpus()) for c in cands] == [("1 replica x 2 threads", "0-1"),
                                                      ("2 replicas x 1 thread", "0 | 1")]
    # per-socket, single and per-l3 plan to the same single replica, tried once; the split is the planner's own
    assert [c.placement for c in cands] == [{"strategy": "per-numa-node"},
                                            {"strategy": "per-numa-node", "replicas_per_node": 2}]
    # < 4 cores: the default policy reserves none (an unset reserved_cpus stays unset in every candidate)
    assert all(not r.frontend_cpus for c in cands for r in c.plan.replicas)
    assert all(plans_the_same(path, c) for c in cands) and notes == []


def test_placements_the_planner_refuses_are_dropped_with_its_reason(tmp_path, sysroots):
    # 16 GB of bf16 weights fit the 24 GiB node once, not in two halves
    cands, notes = found(spec(tmp_path, sysroots["two-cpu"], QWEN3_8B))
    assert [c.shape() for c in cands] == ["1 replica x 2 threads"]
    assert len(notes) == 1 and notes[0].startswith("per-numa-node x2: not tried, the planner refuses it here: ")
    assert "cannot hold 2 replicas" in notes[0]


@pytest.mark.slow
def test_a_two_socket_smt_host_varies_granularity_and_smt_and_keeps_the_users_knobs(tmp_path, sysroots):
    path = spec(tmp_path, sysroots["epyc-2s-nps1"], reserved_cpus=1, threads=8)
    cands, notes = found(path)
    assert len({c.layout for c in cands}) == len(cands)  # no two candidates run the same CPUs
    by = {c.label: c for c in cands}
    assert {"per-numa-node", "single", "per-l3 x2", "per-l3 x6", "per-numa-node (SMT)", "per-l3 (SMT)"} <= set(by)
    assert by["per-numa-node"].shape() == "2 replicas x 8 threads"
    assert by["per-numa-node"].cpus() == "0-7 (+front 95,287) | 96-103 (+front 191,383)"
    assert by["per-l3 x2"].placement == {"reserved_cpus": 1, "threads": 8, "strategy": "per-l3",
                                         "l3_groups_per_replica": 2, "use_smt": False}
    assert len(by["per-l3 (SMT)"].plan.replicas) == 24
    assert all(plans_the_same(path, c) for c in cands)
    # threads 8 leaves a 7-core L3 group (one core reserved) and the 24-per-node splits out, with the reason
    assert "per-l3: not tried, the planner refuses it here: placement.threads: replica 0: threads 8 > 7" in notes[0]
    assert any(n.startswith("per-numa-node x24 (SMT): not tried") for n in notes)
