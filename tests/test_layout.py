"""Placement v2 on the machines of the issue: replicas per L3 group and N per NUMA node, read from real-looking cache
files. Golden plans (JSON and the core-map table) live in tests/golden/plans/<case>.{json,txt}; UPDATE_GOLDEN=1
rewrites them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploykit import hardware, layout, memory, planner, report, specfile, topology
from deploykit.errors import PlanError
from tests.conftest import QWEN3_8B, make_spec

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "plans"
EPYC = ROOT / "examples" / "epyc-9655-2s.sysroot.tar.gz"  # 2x EPYC 9655: 12 CCDs of 8 cores per socket, SMT 2
QWEN3 = {"source": "Qwen/Qwen3-8B", "max_model_len": 32768, "architecture": QWEN3_8B}
LLAMA_70B = {"source": "meta-llama/Llama-3.1-70B", "max_model_len": 32768,
             "architecture": {"num_parameters": 70_553_706_496, "num_hidden_layers": 80, "num_key_value_heads": 8,
                              "head_dim": 128, "max_position_embeddings": 131072}}

# case: (machine: a tests/sysroots name or "epyc-snapshot", placement)
CASES = {
    "epyc-per-l3": ("epyc-snapshot", {"strategy": "per-l3"}),
    "epyc-replicas-per-node-4": ("epyc-snapshot", {"replicas_per_node": 4}),
    "xeon-per-l3-is-per-socket": ("xeon-2s", {"strategy": "per-l3"}),
    "epyc-cpuset-cuts-l3-per-l3": ("epyc-cpuset-cuts-l3", {"strategy": "per-l3"}),
    "epyc-cpuset-cuts-l3-replicas-per-node-2": ("epyc-cpuset-cuts-l3", {"replicas_per_node": 2}),
}


def _topo(sysroots, machine: str) -> topology.Topology:
    return topology.read(EPYC if machine == "epyc-snapshot" else sysroots[machine])


def plan_for(sysroots, machine: str, placement: dict, model: dict | None = None):
    spec = specfile.from_data(make_spec(model=model or QWEN3, placement=placement))
    topo = _topo(sysroots, machine)
    return planner.make_plan(spec, topo, memory.shape(spec.model)), topo


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow
def test_golden_plan(case, sysroots):
    plan, topo = plan_for(sysroots, *CASES[case])
    got = {f"{case}.json": plan.to_json(), f"{case}.txt": report.plan_text(plan, topo)}
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name, text in got.items():
            (GOLDEN / name).write_text(text)
    for name, text in got.items():
        assert (GOLDEN / name).read_text() == text, f"{name} differs from the golden (UPDATE_GOLDEN=1 to accept)"
    assert plan_for(sysroots, *CASES[case])[0] == plan  # deterministic


@pytest.mark.slow
def test_epyc_per_l3_is_one_replica_per_ccd_with_its_own_front_end_core(sysroots):
    plan, _ = plan_for(sysroots, "epyc-snapshot", {"strategy": "per-l3"})
    assert len(plan.replicas) == 24 and plan.layout.l3_aligned
    r0, r13 = plan.replicas[0], plan.replicas[13]
    assert (r0.cpus, r0.frontend_cpus, r0.mems, r0.l3_groups, r0.cores) == (tuple(range(7)), (7, 199), (0,), (0,), 8)
    assert (r13.cpus, r13.frontend_cpus, r13.mems, r13.l3_groups) == (tuple(range(104, 111)), (111, 303), (1,), (13,))
    assert r0.memory_bytes == 768 * 1024**3 // 12  # each replica holds its own weights: a twelfth of the node
    assert plan.serving.load_balancer and [r.port for r in plan.replicas] == list(range(8001, 8025))


@pytest.mark.slow
def test_replicas_per_node_4_takes_three_whole_ccds_each(sysroots):
    plan, _ = plan_for(sysroots, "epyc-snapshot", {"replicas_per_node": 4, "use_smt": True})
    assert len(plan.replicas) == 8 and plan.layout.l3_aligned and not plan.warnings
    r1 = plan.replicas[1]
    assert r1.l3_groups == (3, 4, 5) and r1.frontend_cpus == (47, 239)
    assert r1.cpus == tuple(range(24, 47)) + tuple(range(216, 239))  # SMT: both siblings of 23 cores


@pytest.mark.slow
def test_groups_per_replica_and_an_unaligned_count_say_what_they_did(sysroots):
    plan, _ = plan_for(sysroots, "epyc-snapshot", {"strategy": "per-l3", "l3_groups_per_replica": 5})
    assert [len(r.l3_groups) for r in plan.replicas[:3]] == [5, 5, 2]
    assert any("12 L3 groups do not divide by l3_groups_per_replica 5" in w for w in plan.warnings)
    plan, _ = plan_for(sysroots, "epyc-snapshot", {"replicas_per_node": 5})
    assert not plan.layout.l3_aligned and len(plan.replicas) == 10
    assert any("replicas_per_node 5 cannot align to the 12 L3 groups of NUMA node 0" in w
               and "values that align here: 1, 2, 3, 4, 6, 12, 24, 48, 96" in w for w in plan.warnings)


def test_intel_l3_is_the_socket_so_per_l3_is_per_socket_and_says_so(sysroots):
    per_l3, _ = plan_for(sysroots, "xeon-2s", {"strategy": "per-l3"})
    per_socket, _ = plan_for(sysroots, "xeon-2s", {"strategy": "per-socket"})
    assert [r.cpus for r in per_l3.replicas] == [r.cpus for r in per_socket.replicas]
    assert any("per-l3 places exactly as per-socket" in w for w in per_l3.warnings)
    assert not per_l3.layout.l3_aligned  # one replica per node: nothing for the kubelet to align


def test_a_cpuset_that_cuts_an_l3_group(sysroots):
    per_l3, _ = plan_for(sysroots, "epyc-cpuset-cuts-l3", {"strategy": "per-l3"})
    assert [(r.cpus, r.frontend_cpus) for r in per_l3.replicas] == [(tuple(range(7)), (7, 199)),
                                                                     ((8, 9, 10), (11, 203))]
    assert any("L3 group 1 is cut by the cpuset: 4 of its 8 cores on NUMA node 0 are allowed" in w
               for w in per_l3.warnings)
    halves, _ = plan_for(sysroots, "epyc-cpuset-cuts-l3", {"replicas_per_node": 2})
    assert [r.l3_groups for r in halves.replicas] == [(0,), (0, 1)] and not halves.layout.l3_aligned
    assert any("cannot align" in w and "per-l3 keeps each replica in whole L3 groups" in w for w in halves.warnings)


def test_a_host_without_cache_files_plans_as_before_and_says_so(sysroots):
    plan, _ = plan_for(sysroots, "quota4-in-16", {"replicas_per_node": 2})
    assert len(plan.replicas) == 2 and plan.replicas[0].l3_groups == () and not plan.layout.l3_aligned
    assert any("L3 groups are unknown" in w for w in plan.warnings)
    with pytest.raises(PlanError, match="strategy per-l3 needs the L3 groups") as e:
        plan_for(sysroots, "quota4-in-16", {"strategy": "per-l3"})
    assert "topology snapshot" in str(e.value)


@pytest.mark.slow
def test_too_many_replicas_for_the_node_memory_name_the_numbers_and_the_largest_count(tmp_path):
    spec = tmp_path / "big.yaml"
    spec.write_text(__import__("yaml").safe_dump(make_spec(model=LLAMA_70B, hardware={"sysroot": str(EPYC)},
                                                           placement={"strategy": "per-l3"})))
    r = subprocess.run([sys.executable, "-m", "deploykit.cli", "plan", str(spec)], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 5 and "Traceback" not in r.stderr, r.stderr
    assert "cannot hold 12 replicas, each with its own weights: 12 x (weights 131.4 GiB" in r.stderr
    assert "at most 4 replicas fit" in r.stderr and "placement.l3_groups_per_replica: 3" in r.stderr
    spec.write_text(spec.read_text().replace("strategy: per-l3", "replicas_per_node: 6"))
    r = subprocess.run([sys.executable, "-m", "deploykit.cli", "plan", str(spec)], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 5 and "at most 4 replicas fit" in r.stderr and "placement.replicas_per_node: 4" in r.stderr


@pytest.mark.parametrize("placement, needle", [
    ({"strategy": "per-socket", "replicas_per_node": 2}, "replicas_per_node is only used with strategy: per-numa-node"),
    ({"strategy": "per-numa-node", "l3_groups_per_replica": 2}, "l3_groups_per_replica is only used with strategy: "
                                                                 "per-l3"),
    ({"replicas_per_node": 0}, "placement.replicas_per_node: input should be greater than 0"),
    ({"strategy": "per-l4"}, "did you mean `per-l3`"),
])
def test_spec_validation_of_the_new_knobs(placement, needle):
    with pytest.raises(Exception) as e:
        specfile.from_data(make_spec(placement=placement))
    assert needle in str(e.value)


def test_more_replicas_than_cores_is_an_error_naming_the_field(sysroots):
    with pytest.raises(PlanError) as e:
        plan_for(sysroots, "two-cpu", {"replicas_per_node": 3})
    assert e.value.problems[0].path == "placement.replicas_per_node" and "1-2" in str(e.value)


@pytest.mark.slow
def test_placement_choices_for_the_bench_sweep(sysroots):
    spec = specfile.from_data(make_spec(model=QWEN3, placement={"reserved_cpus": 1}))
    topo = _topo(sysroots, "epyc-snapshot")
    names = [layout.describe(pl) for pl in layout.choices(spec.placement, topo)]
    # per-socket and per-l3 x12 give the per-numa-node replicas again; replicas_per_node 2-12 the per-l3 ones
    assert names == ["per-numa-node", "single", "per-l3", "per-l3 x2", "per-l3 x3", "per-l3 x4", "per-l3 x6",
                     "per-numa-node x24", "per-numa-node x48", "per-numa-node x96"]
    assert all(pl.reserved_cpus == 1 for pl in layout.choices(spec.placement, topo))
    fits = dict(planner.feasible(spec, topo, memory.shape(spec.model)))
    assert "per-l3" in fits and len(fits["per-l3"].replicas) == 24
    assert "per-numa-node x96" not in fits  # 96 copies of 16 GiB of weights do not fit a 768 GiB node


@pytest.mark.slow
def test_topology_reads_l3_groups_and_show_prints_them(sysroots, tmp_path):
    topo = _topo(sysroots, "epyc-snapshot")
    assert len(topo.l3_groups) == 24 and topo.l3_groups[1].cpus == tuple(range(8, 16)) + tuple(range(200, 208))
    assert topo.cpu(203).l3 == 1 and topo.l3_groups[0].size_bytes == 32 * 1024**2
    text = report.topology_text(topo)
    assert "NUMA node 0: 768.0 GiB, CPUs 0-95,192-287 (96 cores, 12 L3 groups)" in text
    assert "    L3 1 (32.0 MiB, 8 cores): 8+200 9+201" in text
    assert "L3 groups are unknown" in report.topology_text(topology.read(sysroots["quota4-in-16"]))
    # a cache directory that contradicts itself is no L3 information, not half of it
    broken = Path(shutil.copytree(sysroots["two-cpu"], tmp_path / "broken"))
    (broken / "sys/devices/system/cpu/cpu1/cache/index3/shared_cpu_list").write_text("1\n")
    assert topology.read(broken).l3_groups == ()


def test_inline_hardware_has_no_l3_groups_and_says_how_to_get_them():
    spec = specfile.from_data(make_spec(placement={"strategy": "per-l3"}, hardware={
        "numa_nodes": [{"id": 0, "cpus": "0-7", "memory": "64GiB"}]}))
    with pytest.raises(PlanError, match="inline hardware cannot describe L3 groups"):
        planner.make_plan(spec, hardware.resolve(spec), memory.shape(spec.model))
