"""The deploykit command as users run it: exit codes, messages without tracebacks, --sysroot, JSON output."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import make_spec

ROOT = Path(__file__).resolve().parents[1]


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "deploykit.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT)


def write_spec(tmp_path, **sections):
    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(make_spec(**sections)))
    return f


def test_validate_ok_and_invalid_exit_2_without_traceback(tmp_path):
    assert run("validate", write_spec(tmp_path)).returncode == 0
    bad = write_spec(tmp_path, placement={"use_smtt": True})
    r = run("validate", bad)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "placement.use_smtt" in r.stderr and "did you mean `use_smt`" in r.stderr


def test_plan_json_documented_fields_and_sysroot_override(tmp_path, sysroots):
    spec = write_spec(tmp_path, hardware={"sysroot": str(sysroots["two-cpu"])})
    r = run("plan", spec, "--sysroot", sysroots["epyc-2s-nps1"], "--format", "json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert isinstance(plan["warnings"], list) and len(plan["replicas"]) == 2
    r0 = plan["replicas"][0]
    # Each fact once: CPU sets in the Linux list syntax, no derived twins (*_list, cpuset, env).
    assert set(r0) == {"index", "name", "numa_nodes", "cpus", "frontend_cpus", "mems", "omp_threads", "port",
                       "memory_bytes", "weight_bytes", "kv_cache_bytes", "memory_limit_bytes", "cores", "l3_groups"}
    assert (r0["cpus"], r0["frontend_cpus"], r0["mems"], r0["omp_threads"]) == ("0-94", "95,287", "0", 95)


def test_plan_table_shows_core_map_and_warnings(tmp_path, sysroots):
    r = run("plan", write_spec(tmp_path), "--sysroot", sysroots["quota4-in-16"])
    assert r.returncode == 0
    assert "III" in r.stdout and "F" in r.stdout and "CFS quota of 4 CPUs" in r.stdout


@pytest.mark.parametrize("sections,code,needle", [
    ({"model": {"source": "/nonexistent/model"}}, 4, "model not found"),
    ({"placement": {"numa_nodes": [7]}}, 5, "NUMA node 7 does not exist"),
])
def test_error_exit_codes(tmp_path, sysroots, sections, code, needle):
    r = run("plan", write_spec(tmp_path, **sections), "--sysroot", sysroots["two-cpu"])
    assert r.returncode == code, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_missing_spec_and_bad_sysroot(tmp_path):
    r = run("plan", tmp_path / "nope.yaml")
    assert r.returncode == 2 and "spec file not found" in r.stderr
    r = run("plan", write_spec(tmp_path), "--sysroot", tmp_path)
    assert r.returncode == 3 and "not a sysroot" in r.stderr


def test_topology_show_and_snapshot(tmp_path, sysroots):
    r = run("topology", "show", "--sysroot", sysroots["cxl-offline"])
    assert r.returncode == 0
    assert "offline CPUs: 15,31" in r.stdout and "memory only" in r.stdout and "ISA tier amx" in r.stdout
    assert run("topology", "snapshot", tmp_path / "snap", "--sysroot", sysroots["cxl-offline"]).returncode == 0
    assert run("topology", "show", "--sysroot", tmp_path / "snap").stdout == r.stdout
    assert run("topology", "snapshot", tmp_path / "snap").returncode == 6  # non-empty: refuse without --force
    assert run("topology", "show", "--format", "json").returncode == 0


@pytest.mark.slow
def test_examples_plan_cleanly():
    plans = {}
    for name in ("epyc-9655-2s.yaml", "xeon-amx-2s.yaml"):
        r = run("plan", ROOT / "examples" / name, "--format", "json")
        assert r.returncode == 0, r.stderr
        plans[name] = json.loads(r.stdout)
    epyc = plans["epyc-9655-2s.yaml"]["replicas"]  # the user report's box: 2 x 95 threads, not 2 threads
    assert [(r["cpus"], r["frontend_cpus"], r["mems"]) for r in epyc] == \
        [("0-94", "95,287", "0"), ("96-190", "191,383", "1")]
    xeon = plans["xeon-amx-2s.yaml"]
    assert xeon["hardware"]["isa_tier"] == "amx" and xeon["model"]["dtype"] == "bfloat16"
    assert run("validate", ROOT / "examples" / "single-socket.yaml").returncode == 0


@pytest.mark.slow
def test_single_socket_example_plans_on_this_host_and_explains_itself(tmp_path):
    """`deploykit plan` on the live host (2 CPUs in CI) gives a runnable plan and says what it did."""
    (tmp_path / "examples").mkdir()
    spec = tmp_path / "examples" / "single-socket.yaml"
    spec.write_text((ROOT / "examples" / "single-socket.yaml").read_text())
    model = tmp_path / "models" / "tiny-qwen2"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 2048}))
    r = run("plan", spec, "--format", "json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    allowed = Path("/proc/self/status").read_text().split("Cpus_allowed_list:")[1].split()[0]
    (rep,) = plan["replicas"]
    cpus = set(_parse(rep["cpus"]) + _parse(rep["frontend_cpus"]))
    assert rep["omp_threads"] >= 1 and cpus <= set(_parse(allowed))
    if len(_parse(allowed)) < 4:
        assert rep["frontend_cpus"] == "" and any("none is reserved" in w for w in plan["warnings"])
    table = run("plan", spec)
    assert table.returncode == 0 and "tiny-0" in table.stdout


def _parse(text):
    from deploykit import cpulist
    return cpulist.parse(text)


@pytest.mark.slow
def test_example_snapshot_matches_its_generator(tmp_path):
    """examples/epyc-9655-2s.sysroot.tar.gz is synthesized by tests/sysroots.py; UPDATE_GOLDEN=1 rewrites it."""
    import os

    from deploykit import snapshot
    from tests.sysroots import MACHINES, write
    src = write(MACHINES["epyc-2s-nps1"], tmp_path / "src")
    snapshot.take(tmp_path / "new.tar.gz", src)
    target = ROOT / "examples" / "epyc-9655-2s.sysroot.tar.gz"
    if os.environ.get("UPDATE_GOLDEN"):
        target.write_bytes((tmp_path / "new.tar.gz").read_bytes())
    assert target.read_bytes() == (tmp_path / "new.tar.gz").read_bytes()


def test_cli_never_imports_torch(tmp_path, sysroots):
    """Nor bench's httpx, httptools, uvloop, rich and matplotlib (its extras): they load only when `deploykit bench`
    runs."""
    code = ("import sys; from deploykit import cli; cli.main(['plan', sys.argv[1], '--sysroot', sys.argv[2]]); "
            "import deploykit.render.seccomp; "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'engine', 'httpx', 'httptools', 'uvloop', 'rich', 'matplotlib')]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code, str(write_spec(tmp_path)), str(sysroots["epyc-2s-nps1"])],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_an_unsupported_gguf_architecture_exits_4_naming_what_loads(tmp_path, sysroots):
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    w.add_uint32("falcon.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((8, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = run("plan", write_spec(tmp_path, model={"source": str(tmp_path / "falcon.gguf")}), "--sysroot",
            sysroots["two-cpu"])
    assert r.returncode == 4 and "Traceback" not in r.stderr, r.stderr
    assert "GGUF architecture 'falcon' is not supported" in r.stderr and "llama, qwen2, qwen3" in r.stderr
