"""Plans built field by field, for tests that need exact replica values (CPUs, memory nodes, KV sizes) rather than
what the planner would choose on this host."""
from __future__ import annotations

from pathlib import Path

from deploykit.plan import (HardwareSummary, ImagePlan, ModelPlan, Plan, Replica, SecurityPlan, ServingPlan)


def replica(index: int, cpus: list[int], frontend_cpus: list[int], mems: list[int], kv_cache_bytes: int) -> Replica:
    return Replica(index=index, name=f"test-{index}", numa_nodes=tuple(mems), cpus=tuple(cpus),
                   frontend_cpus=tuple(frontend_cpus), mems=tuple(mems), omp_threads=len(cpus), port=8001 + index,
                   memory_bytes=64 << 30, weight_bytes=1 << 20, kv_cache_bytes=kv_cache_bytes,
                   memory_limit_bytes=4 << 30)


def make_plan(replicas: list[Replica], *, model_path: str = "/model", dtype: str = "float32",
              max_model_len: int = 2048, served_name: str = "planned", max_num_seqs: int = 4,
              max_num_batched_tokens: int = 256, api_key_env: str | None = None) -> Plan:
    return Plan(
        name="test",
        model=ModelPlan(source=model_path, path=model_path, architecture="LlamaForCausalLM", dtype=dtype,
                        max_model_len=max_model_len, num_parameters=1 << 19, weight_bytes=1 << 20,
                        kv_bytes_per_token=1024, served_name=served_name, sized_from="safetensors"),
        replicas=tuple(replicas),
        serving=ServingPlan(port=8000, publish_address="127.0.0.1", max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens, api_key_env=api_key_env,
                            api_key_secret=None, load_balancer=len(replicas) > 1),
        image=ImagePlan(name="deploykit-engine", tag="test", base="python:3.11-slim-bookworm", wheelhouse=None),
        security=SecurityPlan(seccomp="least-privilege", run_as_user=10001, read_only_root=True),
        targets=("docker",),
        hardware=HardwareSummary(source="inline", cpu_model="", isa_tier="avx512", isa=(), sockets=1,
                                 numa_nodes=2, threads_per_core=1, online_cpus=8, allowed_cpus=tuple(range(8)),
                                 quota_cpus=None))


def write(plan: Plan, path: Path) -> str:
    path.write_text(plan.to_json())
    return str(path)
