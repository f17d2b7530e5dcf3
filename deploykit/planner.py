"""(Spec, Topology, ModelShape) -> Plan: a pure function, no I/O. Decides replicas, CPUs, memory nodes and sizes.

Memory rule per replica: weights + KV cache + headroom must fit in the replica's share of its NUMA nodes'
memory; headroom = 1 GiB + 10 % (runtime, activations, page cache, other processes).
"""

from __future__ import annotations

from collections import Counter

from . import cpulist, isa, layout, memory, modelconfig, modelfiles, placement
from .errors import PlanError
from .memory import ModelShape
from .plan import (BindingPolicy, HardwareSummary, ImagePlan, Layout, ModelPlan, Plan, Replica, SecurityPlan,
                   ServingPlan)
from .spec import InlineHardware, Spec, SysrootHardware
from .topology import Topology
from .units import human

GiB = 1024**3
API_KEY_ENV = "DEPLOYKIT_API_KEY"


def headroom(memory_bytes: int) -> int:
    """Memory of a replica's nodes kept free of weights and KV (runtime, activations, page cache, the OS)."""
    return GiB + memory_bytes // 10


def container_limit(model_bytes: int) -> int:
    """The container's memory limit: weights + KV, plus the engine's own runtime (Python, torch, activation
    buffers for max_num_batched_tokens) and 10 % slack; it follows the workload, not the node."""
    return model_bytes + 2 * GiB + model_bytes // 10


def make_plan(spec: Spec, topo: Topology, shape: ModelShape) -> Plan:
    warnings: list[str] = []
    dtype, notes = memory.resolve_dtype(spec.model.dtype, topo.has_bf16)
    warnings += notes
    if dtype == "bfloat16" and not topo.has_bf16:
        if topo.isa_tier == "avx512":
            warnings.append("bfloat16 on a CPU without AVX512-BF16/AMX: the engine's AVX-512F kernels widen bf16 to "
                            "fp32 in registers, so decode streams half the bytes of float32 but prefill runs at fp32 "
                            "speed")
        else:
            warnings.append(f"bfloat16 on a CPU without AVX-512 (ISA tier {topo.isa_tier}) is emulated and slow; "
                            "model.dtype: float32 (or auto) is faster here")
    if spec.security.seccomp == "unconfined":
        warnings.append("security.seccomp is 'unconfined': the containers run without any syscall filter; "
                        "least-privilege allows NUMA binding and page migration and still blocks mount, ptrace, bpf")
    warnings += _security_notes(spec)
    max_len = modelconfig.context_length(shape.max_position_embeddings, spec.model.max_model_len,
                                         field="model.max_model_len", error=PlanError)
    cut = layout.cut(spec.placement, topo)
    warnings += cut.notes
    groups = [(g.nodes, g.cpus) for g in cut.groups]
    quota = topo.quota_cpus / len(groups) if topo.quota_cpus is not None else None

    # One translation of the spec's placement knobs: used here and by the engine's `binding: auto` at start-up.
    policy = BindingPolicy(
        reserved_cpus=spec.placement.reserved_cpus if "reserved_cpus" in spec.placement.model_fields_set else None,
        use_smt=spec.placement.use_smt,
        threads=None if spec.placement.threads == "auto" else spec.placement.threads)
    choices = []
    for i, (nodes, cands) in enumerate(groups):
        label = f"replica {i}"
        ch = placement.choose(topo, cands, reserved=policy.reserved_cpus, use_smt=policy.use_smt,
                              threads=policy.threads, quota=quota, label=label)
        warnings += ch.notes
        choices.append((nodes, ch, _mems(spec, topo, nodes, label)))

    sharers = Counter(m for _, _, mems in choices for m in mems)
    # Quantized weights run on the int8 kernels of AVX512-VNNI CPUs and are sized as held there; elsewhere they are
    # dequantized at load and sized in `dtype` (deploykit/quant.py is the rule the engine applies too).
    # Both need the native decoder: transformers (every other architecture) holds every weight in `dtype`.
    native_model = shape.architecture in modelconfig.NATIVE_ARCHITECTURES
    qz, native_quant = spec.model.quantization, isa.quantized_kernels(topo.isa) and native_model
    # A bf16 checkpoint's matrices stay bf16 under float32 compute where a native kernel build runs (memory.held_dtype).
    weights = shape.weight_bytes(dtype, qz, native_quant, isa.fp32_kernels(topo.isa) and native_model)
    formats = shape.held_formats(qz, native_quant)
    if qz in ("q8_0", "q4_0") and not native_quant:
        why = f"this CPU (ISA tier {topo.isa_tier}) lacks" if native_model else \
            f"{shape.architecture} runs through transformers, not the native decoder that has"
        warnings.append(f"model.quantization {qz!r} needs the engine's int8 kernels (AVX-512 with AVX512-VNNI, or "
                        f"AVX2), which {why} them: the weights stay in {dtype}")
    per_token = shape.kv_bytes_per_token(dtype)
    multi = len(choices) > 1
    replicas = []
    for i, (nodes, ch, mems) in enumerate(choices):
        mem = sum(topo.node(m).memory_bytes // sharers[m] for m in mems)
        if topo.memory_limit_bytes is not None:
            mem = min(mem, topo.memory_limit_bytes // len(choices))
        _replicas_fit(spec, nodes, mem, sum(other == nodes for other, _, _ in choices), weights,
                      memory.one_sequence_bytes(per_token, max_len), max_len)
        kv = _kv_bytes(spec, i, nodes, mem, weights, per_token, max_len, multi, dtype)
        limit = container_limit(weights + kv)
        replicas.append(Replica(
            index=i, name=f"{spec.name}-{i}", numa_nodes=nodes, cpus=ch.cpus, frontend_cpus=ch.frontend_cpus,
            mems=mems, omp_threads=len(ch.cpus), port=spec.serving.port + (i + 1 if multi else 0),
            memory_bytes=mem, weight_bytes=weights, kv_cache_bytes=kv, memory_limit_bytes=min(limit, mem),
            cores=len(placement.physical_cores(topo, (*ch.cpus, *ch.frontend_cpus))),
            l3_groups=tuple(sorted({topo.cpu(c).l3 for c in (*ch.cpus, *ch.frontend_cpus)})) if topo.l3_groups
            else ()))
        if len(nodes) > 1 and spec.placement.strategy == "explicit":
            warnings.append(f"replica {i} spans NUMA nodes {cpulist.format(nodes)}: memory accesses cross nodes")

    sv = spec.serving
    key = sv.api_key
    last_port = sv.port + (len(replicas) if multi else 0)
    if last_port > 65535:
        raise PlanError(f"replica ports run from {sv.port + 1} to {last_port}, past 65535", path="serving.port",
                        value=sv.port, allowed=f"1-{65535 - len(replicas)}",
                        hint="pick a lower port: with several replicas the load balancer takes serving.port and the "
                             "replicas the ports after it")
    # The engine always reads the key from an environment variable; a secret reference says where Kubernetes
    # fills it from, and Docker/compose pass DEPLOYKIT_API_KEY from the host by name.
    key_env = getattr(key, "env", None) or (API_KEY_ENV if key is not None else None)
    return Plan(
        name=spec.name,
        model=ModelPlan(source=shape.source, path=shape.path, architecture=shape.architecture, dtype=dtype,
                        max_model_len=max_len, num_parameters=shape.num_parameters, weight_bytes=weights,
                        kv_bytes_per_token=per_token,
                        served_name=sv.served_model_name or modelfiles.served_name(spec.model.source),
                        sized_from=shape.counted_from, quantization=qz, weight_formats=formats),
        replicas=tuple(replicas),
        serving=ServingPlan(port=sv.port, publish_address=sv.publish_address, max_num_seqs=sv.max_num_seqs,
                            max_num_batched_tokens=sv.max_num_batched_tokens, api_key_env=key_env,
                            api_key_secret=(key.secret, key.key) if key is not None and hasattr(key, "secret")
                            else None, load_balancer=multi, prefix_caching=sv.prefix_caching),
        image=ImagePlan(name=spec.image.name, tag=spec.image.tag, base=spec.image.base,
                        wheelhouse=spec.image.wheelhouse, digest=spec.image.digest),
        security=SecurityPlan(seccomp=spec.security.seccomp, run_as_user=spec.security.run_as_user,
                              read_only_root=spec.security.read_only_root, sys_nice=spec.security.sys_nice),
        targets=spec.targets,
        hardware=HardwareSummary(
            source="sysroot" if isinstance(spec.hardware, SysrootHardware) or topo.source not in ("/", "inline")
            else "inline" if isinstance(spec.hardware, InlineHardware) else "auto",
            cpu_model=topo.cpu_model, isa_tier=topo.isa_tier, isa=topo.isa, sockets=len(topo.sockets),
            numa_nodes=len(topo.nodes), threads_per_core=topo.threads_per_core, online_cpus=len(topo.cpus),
            allowed_cpus=topo.allowed_cpus, quota_cpus=topo.quota_cpus),
        warnings=tuple(warnings),
        policy=policy,
        layout=Layout(strategy=spec.placement.strategy, replicas_per_node=spec.placement.replicas_per_node,
                      l3_groups_per_replica=spec.placement.l3_groups_per_replica, l3_aligned=cut.l3_aligned),
    )


def feasible(spec: Spec, topo: Topology, shape: ModelShape,
             refused: list[tuple[str, str]] | None = None) -> tuple[tuple[str, Plan], ...]:
    """Every placement layout.choices() offers for this spec on this machine that plans (memory included), as
    (short name, Plan), in that order: what `deploykit bench --sweep` runs. `refused` collects (short name, the
    planner's first line) for the others."""
    out = []
    for pl in layout.choices(spec.placement, topo):
        try:
            out.append((layout.describe(pl), make_plan(spec.model_copy(update={"placement": pl}), topo, shape)))
        except PlanError as e:
            if refused is not None:
                refused.append((layout.describe(pl), str(e).splitlines()[0]))
    return tuple(out)


def _replicas_fit(spec: Spec, nodes: tuple[int, ...], mem: int, count: int, weights: int,
                  one_seq: int, max_len: int) -> None:
    """Replicas sharing a NUMA node each hold their own weights: `count` of them need count x (weights + one
    sequence's KV + headroom) of the node. When they do not fit, the error gives the numbers and the largest count
    that does (a replica alone that cannot fit is _kv_bytes's error)."""
    def fits(share: int) -> bool:
        return weights + one_seq + headroom(share) <= share

    if count < 2 or fits(mem):
        return
    total = mem * count
    best = max((n for n in range(1, count) if fits(total // n)), default=0)
    if not best:
        return
    pl = spec.placement
    where = f"NUMA node{'s' if len(nodes) > 1 else ''} {cpulist.format(nodes)} ({human(total)} for replicas)"
    if pl.strategy == "per-l3":
        per_group = -(-count * pl.l3_groups_per_replica // best)  # L3 groups per replica for at most `best`
        path, value = "placement.l3_groups_per_replica", pl.l3_groups_per_replica
        hint = f"placement.l3_groups_per_replica: {per_group}, or placement.strategy: per-numa-node"
    elif pl.strategy == "per-numa-node":
        path, value, hint = "placement.replicas_per_node", pl.replicas_per_node, f"placement.replicas_per_node: {best}"
    else:
        path, value, hint = "placement.cpus", count, f"at most {best} CPU lists on these nodes"
    raise PlanError(
        f"{where} cannot hold {count} replicas, each with its own weights: {count} x (weights {human(weights)} + KV "
        f"cache for one {max_len}-token sequence {human(one_seq)} + headroom {human(headroom(mem))}) = "
        f"{human(count * (weights + one_seq + headroom(mem)))} > {human(total)}; at most {best} replica"
        f"{'s' if best > 1 else ''} fit", path=path, value=value,
        hint=hint + f"; or a smaller model.max_model_len (now {max_len})")


def _security_notes(spec: Spec) -> list[str]:
    sec = spec.security
    if sec.sys_nice:
        return ["security.sys_nice adds CAP_SYS_NICE to the engine containers: such pods fail the Pod Security "
                "Standard baseline (and restricted); " + ("with the least-privilege seccomp profile it buys only "
                "moving pages shared with other processes, so consider removing it" if sec.seccomp == "least-privilege"
                else "it lets the runtime's default seccomp profile allow set_mempolicy/mbind (never migrate_pages)")]
    if sec.seccomp == "runtime-default":
        return ["security.seccomp is 'runtime-default': Docker's and containerd's default profiles refuse "
                "set_mempolicy/mbind without CAP_SYS_NICE and migrate_pages/move_pages always, so the engine cannot "
                "bind its memory to its NUMA node (docker run still confines it with --cpuset-mems; compose and "
                "Kubernetes without the Memory Manager do not); least-privilege allows them with no capability"]
    return []


def _mems(spec: Spec, topo: Topology, nodes: tuple[int, ...], label: str) -> tuple[int, ...]:
    allowed = set(topo.allowed_mems)
    mems = {n for n in nodes if n in allowed and topo.node(n).memory_bytes > 0}
    for n in nodes:
        if n not in mems:  # CPU-only node (or its memory is outside the cpuset): use the nearest allowed memory
            near = _nearest(topo, n, allowed)
            if near is not None:
                mems.add(near)
    memory_only = (cpulist.format(x.id for x in topo.nodes if x.memory_bytes and not x.cpus)
                   or "none (this machine has no memory-only nodes)")
    for m in spec.placement.memory_nodes:
        if m not in {x.id for x in topo.nodes} or topo.node(m).memory_bytes == 0:
            raise PlanError(f"NUMA node {m} has no memory", path="placement.memory_nodes", value=m,
                            allowed=memory_only)
        if topo.node(m).cpus:
            raise PlanError(f"NUMA node {m} has CPUs: memory_nodes is for memory-only (CXL, HBM) nodes",
                            path="placement.memory_nodes", value=m, allowed=memory_only,
                            hint="choose CPU nodes with placement.numa_nodes, or strategy per-socket / single")
        if m not in allowed:
            raise PlanError(f"NUMA node {m} is outside this process's allowed memory nodes",
                            path="placement.memory_nodes", value=m, allowed=cpulist.format(allowed))
        mems.add(m)
    if not mems:
        raise PlanError(f"{label}: no allowed memory node near NUMA nodes {cpulist.format(nodes)}",
                        hint="check cpuset.mems / Mems_allowed")
    return tuple(sorted(mems))


def _nearest(topo: Topology, node: int, allowed: set[int]) -> int | None:
    """The closest allowed node with memory and CPUs: memory-only (CXL) nodes join mems only when listed in
    placement.memory_nodes, however close the SLIT says they are."""
    ids = [n.id for n in topo.nodes]
    row = topo.node(node).distances
    best = None
    for m in sorted(allowed):
        if topo.node(m).memory_bytes == 0 or not topo.node(m).cpus:
            continue
        d = row[ids.index(m)] if len(row) == len(ids) else abs(m - node) + 10
        if best is None or d < best[0]:
            best = (d, m)
    return best[1] if best else None


def _kv_bytes(spec: Spec, i: int, nodes: tuple[int, ...], mem: int, weights: int, per_token: int, max_len: int,
              multi: bool, dtype: str) -> int:
    one_seq = memory.one_sequence_bytes(per_token, max_len)
    room = headroom(mem)
    where = f"replica {i} (NUMA node{'s' if len(nodes) > 1 else ''} {cpulist.format(nodes)}, {human(mem)})"
    ways = ["placement.strategy: per-socket or single (fewer replicas, each spanning more nodes)" if multi else
            "a machine or NUMA node with more memory"]
    if dtype == "float32":
        ways.append("model.dtype: bfloat16 (half the bytes of float32)")
    ways.append(f"a smaller model.max_model_len (now {max_len})")
    if weights + one_seq + room > mem:
        raise PlanError(
            f"{where} cannot hold the model: weights {human(weights)} + KV cache for one {max_len}-token sequence "
            f"{human(one_seq)} + headroom {human(room)} = {human(weights + one_seq + room)} > {human(mem)}",
            hint="; or ".join(ways))
    if spec.serving.kv_cache == "auto":
        return memory.auto_kv_cache_bytes(per_token, max_len, spec.serving.max_num_seqs, mem - weights - room)
    kv = int(spec.serving.kv_cache)
    if kv < one_seq:
        raise PlanError(f"holds {kv // per_token} tokens, less than one max_model_len sequence ({max_len})",
                        path="serving.kv_cache", value=human(kv), allowed=f">= {human(one_seq)}",
                        hint="raise serving.kv_cache or lower model.max_model_len")
    if weights + kv + room > mem:
        raise PlanError(f"{where}: weights {human(weights)} + KV cache {human(kv)} + headroom {human(room)} > "
                        f"{human(mem)}", path="serving.kv_cache", value=human(kv),
                        allowed=f"<= {human(mem - weights - room)}", hint="lower serving.kv_cache or use 'auto'")
    return kv
