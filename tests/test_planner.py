"""Exact placements on the machines users run: CPU lists per replica, not just counts."""

import pytest

from deploykit import hardware, memory, planner, specfile, topology
from deploykit.errors import PlanError
from deploykit.render.container import replica_env
from tests.conftest import make_spec

GiB = 1024**3


def plan_for(sysroots, machine, **sections):
    spec = specfile.from_data(make_spec(**sections))
    topo = topology.read(sysroots[machine])
    return planner.make_plan(spec, topo, memory.shape(spec.model))


def rng(a, b):
    return tuple(range(a, b + 1))


@pytest.mark.slow
def test_epyc_nps1_one_replica_per_socket_one_thread_per_core(sysroots):
    p = plan_for(sysroots, "epyc-2s-nps1")
    r0, r1 = p.replicas
    assert (r0.cpus, r0.frontend_cpus, r0.mems, r0.numa_nodes) == (rng(0, 94), (95, 287), (0,), (0,))
    assert (r1.cpus, r1.frontend_cpus, r1.mems) == (rng(96, 190), (191, 383), (1,))
    assert r0.omp_threads == 95
    # The containers' environment is derived from those fields where containers are rendered, never stored twice.
    assert dict(replica_env(r1)) == {"OMP_NUM_THREADS": "95", "DEPLOYKIT_CPUS": "96-190",
                                     "DEPLOYKIT_FRONTEND_CPUS": "191,383", "DEPLOYKIT_MEMS": "1"}
    assert (p.serving.port, r0.port, r1.port, p.serving.load_balancer) == (8000, 8001, 8002, True)
    assert p.model.dtype == "bfloat16" and r0.weight_bytes == 8_190_735_360 * 2


def test_epyc_nps1_use_smt_takes_both_siblings(sysroots):
    r0 = plan_for(sysroots, "epyc-2s-nps1", placement={"use_smt": True}).replicas[0]
    assert r0.cpus == rng(0, 94) + rng(192, 286) and r0.omp_threads == 190
    assert r0.frontend_cpus == (95, 287)


@pytest.mark.slow
def test_epyc_nps4_eight_replicas(sysroots):
    p = plan_for(sysroots, "epyc-2s-nps4", model={"source": "Qwen/Qwen3-8B", "max_model_len": 8192,
                                                  "architecture": {"num_parameters": 8_190_735_360,
                                                                   "num_hidden_layers": 36, "num_key_value_heads": 8,
                                                                   "head_dim": 128}})
    assert len(p.replicas) == 8
    r5 = p.replicas[5]
    assert (r5.numa_nodes, r5.cpus, r5.frontend_cpus, r5.mems) == ((5,), rng(120, 142), (143, 335), (5,))
    assert r5.memory_bytes == 192 * GiB


def test_per_socket_strategy_spans_the_socket_nodes(sysroots):
    p = plan_for(sysroots, "epyc-2s-nps4", placement={"strategy": "per-socket"})
    r1 = p.replicas[1]
    assert (r1.numa_nodes, r1.mems) == ((4, 5, 6, 7), (4, 5, 6, 7))
    assert r1.cpus == rng(96, 190) and r1.frontend_cpus == (191, 383)


def test_numa_node_subset_and_threads_cap(sysroots):
    p = plan_for(sysroots, "epyc-2s-nps4", placement={"numa_nodes": [2, 6], "threads": 8, "reserved_cpus": 2})
    a, b = p.replicas
    assert (a.cpus, a.frontend_cpus) == (rng(48, 55), (70, 71, 262, 263))
    assert (b.numa_nodes, b.cpus) == ((6,), rng(144, 151))


def test_xeon_sub_numa_clustering(sysroots):
    p = plan_for(sysroots, "xeon-2s-snc2")
    assert [r.numa_nodes for r in p.replicas] == [(0,), (1,), (2,), (3,)]
    r1 = p.replicas[1]
    assert (r1.cpus, r1.frontend_cpus) == (rng(28, 54), (55, 167))
    assert p.hardware.isa_tier == "amx"


def test_roundrobin_socket_numbering(sysroots):
    r0, r1 = plan_for(sysroots, "roundrobin-2s").replicas
    assert (r0.cpus, r0.frontend_cpus) == ((0, 2, 4, 6, 8, 10, 12), (14, 30))
    assert (r1.cpus, r1.frontend_cpus) == ((1, 3, 5, 7, 9, 11, 13), (15, 31))


def test_container_cpuset_with_both_siblings_and_8_cpu_quota(sysroots):
    p = plan_for(sysroots, "epyc-container-8c")
    assert len(p.replicas) == 1  # node 1 has no allowed CPU
    r = p.replicas[0]
    assert (r.cpus, r.frontend_cpus, r.mems) == (rng(8, 14), (15, 207), (0,))
    assert any("NUMA node 1 skipped" in w for w in p.warnings)


def test_quota_of_4_inside_16_core_cpuset_caps_threads(sysroots):
    p = plan_for(sysroots, "quota4-in-16")
    r = p.replicas[0]
    assert (r.cpus, r.frontend_cpus, r.omp_threads) == ((0, 1, 2), (15,), 3)
    assert any("CFS quota of 4 CPUs" in w for w in p.warnings)


def test_cxl_node_is_never_a_replica_and_only_in_mems_when_asked(sysroots):
    p = plan_for(sysroots, "cxl-offline")
    (r,) = p.replicas
    assert (r.cpus, r.frontend_cpus, r.mems) == (rng(0, 13), (14, 30), (0,))
    r = plan_for(sysroots, "cxl-offline", placement={"memory_nodes": [1]}).replicas[0]
    assert r.mems == (0, 1) and r.memory_bytes == 384 * GiB
    with pytest.raises(PlanError, match="memory-only"):
        plan_for(sysroots, "cxl-offline", placement={"numa_nodes": [1]})


SMALL = {"source": "a/small", "max_model_len": 4096,
         "architecture": {"num_parameters": 1_000_000_000, "num_hidden_layers": 16, "num_key_value_heads": 8,
                          "head_dim": 64}}


def test_desktop_adjacent_siblings(sysroots):
    p = plan_for(sysroots, "desktop-adjacent", model=SMALL)
    r = p.replicas[0]
    assert (r.cpus, r.frontend_cpus) == ((0, 2, 4, 6, 8, 10, 12), (14, 15))
    assert p.model.dtype == "float32"  # no bf16 ISA
    r = plan_for(sysroots, "desktop-adjacent", model=SMALL, placement={"use_smt": True}).replicas[0]
    assert r.cpus == rng(0, 13)


def test_two_cpu_host_shares_the_front_end_and_says_so(sysroots):
    p = plan_for(sysroots, "two-cpu")
    r = p.replicas[0]
    assert (r.cpus, r.frontend_cpus, r.port, p.serving.load_balancer) == ((0, 1), (), 8000, False)
    assert any("none is reserved" in w for w in p.warnings)
    r = plan_for(sysroots, "two-cpu", placement={"reserved_cpus": 1}).replicas[0]
    assert (r.cpus, r.frontend_cpus) == ((0,), (1,))


def test_explicit_cpu_lists(sysroots):
    p = plan_for(sysroots, "epyc-2s-nps1", placement={"strategy": "explicit", "cpus": ["0-15", "96-111,288-303"],
                                                      "reserved_cpus": 0, "use_smt": True})
    a, b = p.replicas
    assert (a.cpus, a.mems) == (rng(0, 15), (0,))
    assert (b.cpus, b.mems, b.numa_nodes) == (rng(96, 111) + rng(288, 303), (1,), (1,))
    with pytest.raises(PlanError, match="outside this process's cpuset") as e:
        plan_for(sysroots, "epyc-container-8c", placement={"strategy": "explicit", "cpus": ["0-3"]})
    assert e.value.problems[0].path == "placement.cpus[0]"
    with pytest.raises(PlanError, match="do not exist or are offline"):
        plan_for(sysroots, "cxl-offline", placement={"strategy": "explicit", "cpus": ["10-20"]})


def test_threads_above_available_cores_is_an_error_with_the_fix(sysroots):
    with pytest.raises(PlanError) as e:
        plan_for(sysroots, "desktop-adjacent", model=SMALL, placement={"threads": 12})
    assert "threads 12 > 7 physical cores" in str(e.value) and "use_smt" in str(e.value)


def test_kv_cache_auto_fills_node_memory_up_to_what_can_be_used(sysroots):
    p = plan_for(sysroots, "epyc-2s-nps1")
    r = p.replicas[0]
    per_seq = p.model.kv_bytes_per_token * 32768
    assert p.model.kv_bytes_per_token == 36 * 2 * 8 * 128 * 2
    assert r.kv_cache_bytes == 16 * per_seq  # max_num_seqs sequences fit easily in 768 GiB
    small = plan_for(sysroots, "two-cpu", model={"source": "x/y", "max_model_len": 4096,
                                                  "architecture": {"num_parameters": 4_000_000_000,
                                                                   "num_hidden_layers": 36, "num_key_value_heads": 8,
                                                                   "head_dim": 128}},
                     serving={"max_num_seqs": 256}).replicas[0]
    room = planner.headroom(24 * GiB)
    assert small.kv_cache_bytes <= 24 * GiB - 8_000_000_000 - room
    assert small.kv_cache_bytes > 24 * GiB - 8_000_000_000 - room - 16 * 147456


def test_model_that_does_not_fit_a_node_explains_the_ways_out(sysroots):
    big = {"source": "meta/llama-70b", "dtype": "float32", "max_model_len": 8192,
           "architecture": {"num_parameters": 70_000_000_000, "num_hidden_layers": 80, "num_key_value_heads": 8,
                            "head_dim": 128}}
    with pytest.raises(PlanError) as e:
        plan_for(sysroots, "epyc-2s-nps4", model=big)
    msg = str(e.value)
    assert "replica 0 (NUMA node 0, 192.0 GiB)" in msg and "weights 260.8 GiB" in msg
    assert "per-socket" in msg and "bfloat16" in msg and "max_model_len" in msg
    ok = plan_for(sysroots, "epyc-2s-nps4", model=big, placement={"strategy": "per-socket"})
    assert len(ok.replicas) == 2


def test_explicit_kv_cache_checks(sysroots):
    with pytest.raises(PlanError, match="less than one max_model_len sequence"):
        plan_for(sysroots, "epyc-2s-nps1", serving={"kv_cache": "1GiB"})
    with pytest.raises(PlanError, match="serving.kv_cache"):
        plan_for(sysroots, "two-cpu", serving={"kv_cache": "40GiB"})
    assert plan_for(sysroots, "epyc-2s-nps1", serving={"kv_cache": "40GiB"}).replicas[0].kv_cache_bytes == 40 * GiB


def test_max_model_len_beyond_the_model_is_rejected(sysroots):
    arch = dict(num_parameters=1000, num_hidden_layers=2, num_key_value_heads=1, head_dim=8,
                max_position_embeddings=2048)
    with pytest.raises(PlanError, match="max_position_embeddings"):
        plan_for(sysroots, "two-cpu", model={"source": "a/b", "max_model_len": 4096, "architecture": arch})


def test_inline_hardware_matches_the_equivalent_sysroot(sysroots):
    inline = {"threads_per_core": 2, "isa": ["avx512f", "avx512bw", "avx512vl", "avx512_bf16"],
              "numa_nodes": [{"id": 0, "socket": 0, "cpus": "0-95,192-287", "memory": "768GiB"},
                             {"id": 1, "socket": 1, "cpus": "96-191,288-383", "memory": "768GiB"}]}
    spec = specfile.from_data(make_spec(hardware=inline))
    via_inline = planner.make_plan(spec, hardware.resolve(spec), memory.shape(spec.model))
    via_sysroot = plan_for(sysroots, "epyc-2s-nps1")
    assert [(r.cpus, r.frontend_cpus, r.mems) for r in via_inline.replicas] == \
           [(r.cpus, r.frontend_cpus, r.mems) for r in via_sysroot.replicas]


def test_plan_on_the_live_host_is_runnable():
    spec = specfile.from_data(make_spec(model={"source": "a/b", "max_model_len": 2048,
                                               "architecture": {"num_parameters": 100_000_000, "num_hidden_layers": 4,
                                                                "num_key_value_heads": 2, "head_dim": 64}}))
    topo = topology.read("/")
    p = planner.make_plan(spec, topo, memory.shape(spec.model))
    assert p.replicas and all(r.omp_threads >= 1 for r in p.replicas)
    assert set(p.replicas[0].cpuset) <= set(topo.allowed_cpus)


def test_replica_ports_must_stay_below_65536(sysroots):
    with pytest.raises(PlanError) as e:
        plan_for(sysroots, "epyc-2s-nps1", serving={"port": 65535})
    assert e.value.problems[0].path == "serving.port" and "1-65533" in str(e.value)


def test_asymmetric_nodes_get_their_own_cores_and_memory(sysroots):
    small = {**SMALL, "architecture": {**SMALL["architecture"], "num_parameters": 500_000_000}}
    a, b = plan_for(sysroots, "asymmetric-2n", model=small, serving={"max_num_seqs": 1024}).replicas
    assert (a.numa_nodes, a.cpus, a.frontend_cpus, a.mems) == ((0,), rng(0, 6), (7, 19), (0,))
    assert (b.numa_nodes, b.cpus, b.frontend_cpus, b.mems) == ((1,), rng(8, 10), (11, 23), (1,))
    assert (a.memory_bytes, b.memory_bytes) == (48 * GiB, 16 * GiB)
    # KV auto-sizing follows each node's own memory, not the average
    assert a.kv_cache_bytes > 2 * b.kv_cache_bytes
    assert b.weight_bytes + b.kv_cache_bytes + planner.headroom(16 * GiB) <= 16 * GiB


def test_quota_below_two_cpus_drops_the_front_end_core(sysroots, tmp_path):
    from tests.sysroots import Machine, write

    root = write(Machine(sockets=1, cores_per_socket=8, threads_per_core=1, node_memory=32 * GiB,
                         quota=(150000, 100000)), tmp_path / "q15")
    spec = specfile.from_data(make_spec(model=SMALL, placement={"reserved_cpus": 1}))
    p = planner.make_plan(spec, topology.read(root), memory.shape(spec.model))
    (r,) = p.replicas
    assert (r.cpus, r.frontend_cpus) == ((0,), ())  # 1.5 CPUs of quota: one thread, front end shares it
    assert any("no room for a front-end core" in w for w in p.warnings)


def test_memory_only_node_is_never_borrowed_for_a_cpu_only_node(tmp_path):
    """A CPU node without memory borrows the nearest CPU node's memory, never the CXL node's (even when the SLIT
    is missing and node ids are all there is to go on)."""
    from tests.sysroots import Machine, write

    root = write(Machine(sockets=2, cores_per_socket=4, threads_per_core=1, node_memory=32 * GiB,
                         memory_only_nodes=(64 * GiB,)), tmp_path / "m")
    node = root / "sys/devices/system/node"
    (node / "node1/meminfo").write_text("Node 1 MemTotal:       0 kB\n")
    for n in range(3):
        (node / f"node{n}/distance").unlink()
    spec = specfile.from_data(make_spec(model=SMALL))
    p = planner.make_plan(spec, topology.read(root), memory.shape(spec.model))
    assert [r.mems for r in p.replicas] == [(0,), (0,)]
    with pytest.raises(PlanError, match="has CPUs: memory_nodes is for memory-only"):
        planner.make_plan(specfile.from_data(make_spec(model=SMALL, placement={"memory_nodes": [0]})),
                          topology.read(root), memory.shape(spec.model))


def test_nodes_without_meminfo_share_memtotal(tmp_path):
    from tests.sysroots import Machine, write

    root = write(Machine(sockets=2, cores_per_socket=4, threads_per_core=1, node_memory=32 * GiB,
                         memory_only_nodes=(64 * GiB,)), tmp_path / "m")
    for n in range(3):
        (root / f"sys/devices/system/node/node{n}/meminfo").unlink()
    topo = topology.read(root)
    share = 128 * GiB // 3  # MemTotal is 128 GiB (2 x 32 + 64 CXL): counted once, split over the 3 nodes
    assert [n.memory_bytes for n in topo.nodes] == [share, share, share]


def test_malformed_distance_file_is_not_a_crash(tmp_path):
    from tests.sysroots import Machine, write

    root = write(Machine(sockets=2, cores_per_socket=4, threads_per_core=1), tmp_path / "m")
    (root / "sys/devices/system/node/node0/distance").write_text("10 twenty\n")
    spec = specfile.from_data(make_spec(model=SMALL))
    p = planner.make_plan(spec, topology.read(root), memory.shape(spec.model))
    assert [r.mems for r in p.replicas] == [(0,), (1,)]


def test_a_bf16_checkpoint_on_an_avx2_cpu_is_planned_at_bf16_bytes(sysroots, tmp_path):
    """No bf16 units: the model runs in float32, but its bf16 matrices stay bf16 (memory.held_dtype), and the plan's
    memory says so."""
    from tests.test_memory import bf16_model_dir
    model = {"source": str(bf16_model_dir(tmp_path))}
    p = plan_for(sysroots, "desktop-adjacent", model=model)  # AVX2, no AVX-512
    assert p.model.dtype == "float32"
    assert p.replicas[0].weight_bytes == 2 * (96 * 64 + 64 * 64) + 4 * (100 * 64 + 128 * 64 + 64)


def test_an_architecture_transformers_runs_is_planned_at_its_dtype_whatever_the_cpu(sysroots, tmp_path):
    """Only the native decoder keeps bf16 or quantized matrices: a model that runs through transformers is sized at
    float32 on an AVX2 CPU, and asking it to quantize says why it cannot."""
    import json

    from tests.test_memory import bf16_model_dir
    d = bf16_model_dir(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"architectures": ["OPTForCausalLM"], "model_type": "opt"}))
    p = plan_for(sysroots, "desktop-adjacent", model={"source": str(d), "quantization": "q8_0"})
    assert p.model.dtype == "float32" and p.model.weight_formats == ()
    assert p.replicas[0].weight_bytes == 4 * (96 * 64 + 64 * 64 + 100 * 64 + 128 * 64 + 64)
    assert any("OPTForCausalLM runs through transformers" in w for w in p.warnings), p.warnings
