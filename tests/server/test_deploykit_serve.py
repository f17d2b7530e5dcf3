"""`deploykit serve SPEC`: the plan's replica on this host, through the same entry point the containers use;
and the engine keeps serving, loudly, when the kernel refuses NUMA binding."""

import subprocess
import sys
from pathlib import Path

import yaml

from tests.server.live import LiveServer, clean_env

ROOT = Path(__file__).resolve().parents[2]
# A real seccomp filter (libseccomp via ctypes), inherited by the engine process: set_mempolicy and
# migrate_pages fail with EPERM, as under Docker's default profile without CAP_SYS_NICE.
REFUSE_NUMA = """
import ctypes, sys
lib = ctypes.CDLL("libseccomp.so.2")
lib.seccomp_init.restype = ctypes.c_void_p
ctx = ctypes.c_void_p(lib.seccomp_init(0x7fff0000))
for name in (b"set_mempolicy", b"migrate_pages"):
    assert lib.seccomp_rule_add(ctx, 0x00050000 | 1, lib.seccomp_syscall_resolve_name(name), 0) == 0
assert lib.seccomp_load(ctx) == 0
from deploykit.cli import main
sys.exit(main(sys.argv[1:]))
"""


def write_spec(tmp_path, model, **placement):
    spec = {"apiVersion": "deploykit/v1", "kind": "Deployment", "name": "local",
            "model": {"source": str(model), "max_model_len": 128},
            "placement": {"strategy": "single", **placement}, "serving": {"max_num_seqs": 4, "kv_cache": "16MiB"}}
    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(spec))
    return f


def test_serves_the_plans_replica_with_its_binding(tmp_path, tiny_model):
    spec = write_spec(tmp_path, tiny_model)
    s = LiveServer(tiny_model, cmd=[sys.executable, "-m", "deploykit.cli", "serve", str(spec)], env=clean_env())
    try:
        s.wait_ready()
        r = s.post("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        eng = s.get("/debug/binding").json()["engine"]
        plan = yaml.safe_load(subprocess.run([sys.executable, "-m", "deploykit.cli", "plan", str(spec), "--format",
                                              "json"], capture_output=True, text=True, cwd=ROOT).stdout)
        assert eng["source"] == "plan" and eng["planned_cpus"] == plan["replicas"][0]["cpus"]
        assert eng["memory_policy"]["mode"] == "bind" and eng["warnings"] == []
        assert s.stop() == 0
    finally:
        s.close()


def test_refused_set_mempolicy_still_serves_and_warns_with_the_fix(tmp_path, tiny_model):
    spec = write_spec(tmp_path, tiny_model)
    s = LiveServer(tiny_model, cmd=[sys.executable, "-c", REFUSE_NUMA, "serve", str(spec)], env=clean_env())
    try:
        s.wait_ready()
        r = s.post("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200
        eng = s.get("/debug/binding").json()["engine"]
        assert eng["memory_policy"]["mode"] == "default"
        (w,) = [w for w in eng["warnings"] if "NUMA memory binding" in w]
        assert "refused (EPERM)" in w and "seccomp profile" in w and "no capability" in w
        assert "NUMA memory binding to node(s)" in s.log()  # loud in the log too
    finally:
        s.close()


def test_model_not_on_this_machine_is_a_clean_error(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"apiVersion": "deploykit/v1", "kind": "Deployment", "name": "x",
                                    "model": {"source": "acme/absent", "max_model_len": 64, "architecture": {
                                        "num_parameters": 1000, "num_hidden_layers": 1, "num_key_value_heads": 1,
                                        "head_dim": 8}}}))
    r = subprocess.run([sys.executable, "-m", "deploykit.cli", "serve", str(spec)], capture_output=True, text=True,
                       cwd=ROOT, env=clean_env(HF_HUB_CACHE=str(tmp_path)))
    assert r.returncode == 4 and "needs the model on this machine" in r.stderr and "Traceback" not in r.stderr
