"""Spec validation: every mistake is a SpecError naming the field, the value, what is allowed, and a fix."""

import copy

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from deploykit import hardware, memory, planner, specfile
from deploykit.errors import DeploykitError, SpecError
from tests.conftest import BASE_SPEC, make_spec

# The issue asks for >= 2,000 examples in CI; each property below runs that many.
EXAMPLES = settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def problems(data):
    with pytest.raises(SpecError) as e:
        specfile.from_data(data)
    return {p.path: p for p in e.value.problems}


def test_minimal_spec_gets_documented_defaults():
    s = specfile.from_data(BASE_SPEC)
    assert s.placement.strategy == "per-numa-node" and s.placement.reserved_cpus == 1
    assert s.placement.use_smt is False and s.placement.threads == "auto"
    assert s.serving.port == 8000 and s.serving.kv_cache == "auto" and s.hardware == "auto"
    assert s.security.seccomp == "least-privilege" and s.targets == ("docker", "compose")


def test_misspelt_key_gets_did_you_mean_and_the_allowed_keys():
    p = problems(make_spec(placement={"reserved_cpu": 2}))["placement.reserved_cpu"]
    assert "did you mean `reserved_cpus`" in p.hint and "use_smt" in p.allowed


def test_misspelt_nested_key_replaces_the_missing_key_error():
    probs = problems(make_spec(hardware={"numa_nodes": [{"id": 0, "cpus": "0-3", "memroy": "8GiB"}]}))
    assert set(probs) == {"hardware.numa_nodes[0].memroy"}
    assert "did you mean `memory`" in probs["hardware.numa_nodes[0].memroy"].hint


def test_bad_enum_value_lists_allowed_values_and_suggests():
    p = problems(make_spec(placement={"strategy": "per-numa"}))["placement.strategy"]
    assert p.value == "per-numa" and "'per-numa-node'" in p.allowed and "per-numa-node" in p.hint


@pytest.mark.parametrize("section,value,path,needle", [
    ({"serving": {"kv_cache": "40 parsecs"}}, None, "serving.kv_cache", "size"),
    ({"serving": {"port": 70000}}, None, "serving.port", "less than or equal"),
    ({"placement": {"threads": 0}}, None, "placement.threads", "positive integer"),
    ({"placement": {"cpus": ["0-3"]}}, None, "placement", "strategy: explicit"),
    ({"placement": {"strategy": "explicit", "cpus": ["0-3", "3-5"]}}, None, "placement", "shares CPUs 3"),
    ({"security": {"run_as_user": 0}}, None, "security.run_as_user", "10000"),
    ({"name": "Bad_Name"}, None, "name", "DNS label"),
    ({"hardware": "this-host"}, None, "hardware", "sysroot"),
    ({"hardware": {"numa_nodes": [{"id": 0, "cpus": "0-3", "memory": "1GiB"}], "threads_per_core": 2,
                   "isa": ["avx512bf16"]}}, None, "hardware.isa[0]", "allowed"),
])
def test_field_errors(section, value, path, needle):
    probs = problems(make_spec(**section))
    assert path in probs, probs
    assert needle in probs[path].render()


def test_api_key_is_never_inline_and_never_echoed():
    p = problems(make_spec(serving={"api_key": "sk-live-123"}))["serving.api_key"]
    assert "never written into the spec" in p.message and "sk-live-123" not in p.render()
    s = specfile.from_data(make_spec(serving={"api_key": {"secret": "llm-key"}}))
    assert (s.serving.api_key.secret, s.serving.api_key.key) == ("llm-key", "api-key")


def test_wrong_api_version_and_kind():
    probs = problems({**BASE_SPEC, "apiVersion": "v2", "kind": "Pod"})
    assert "deploykit/v1" in probs["apiVersion"].allowed and "Deployment" in probs["kind"].allowed


def test_yaml_duplicate_keys_and_syntax_errors_have_line_numbers(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("apiVersion: deploykit/v1\nkind: Deployment\nkind: Deployment\n")
    with pytest.raises(SpecError, match=r"s.yaml:3:1: not valid YAML: duplicate key 'kind'"):
        specfile.load(f)
    f.write_text("a: [1,\n")
    with pytest.raises(SpecError, match="s.yaml:"):
        specfile.load(f)


def test_relative_paths_resolve_against_the_spec_file(tmp_path):
    (tmp_path / "models" / "m").mkdir(parents=True)
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump(make_spec(model={"source": "./models/m"}, hardware={"sysroot": "snap"})))
    s = specfile.load(f)
    assert s.model.source == str(tmp_path / "models" / "m") and s.hardware.sysroot == str(tmp_path / "snap")


def test_sizes_accept_binary_and_decimal_units():
    s = specfile.from_data(make_spec(serving={"kv_cache": "1.5GiB"}))
    assert s.serving.kv_cache == 1610612736
    assert specfile.from_data(make_spec(serving={"kv_cache": "2GB"})).serving.kv_cache == 2_000_000_000


# --- hypothesis: nothing but a Spec or a SpecError, whatever the input ------------------------------------

yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                         st.text(max_size=12), st.sampled_from(["auto", "0-3", "40GiB", "explicit", "single"]))
yaml_values = st.recursive(yaml_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10) | st.sampled_from(list(BASE_SPEC)), inner,
                                                 max_size=4)), max_leaves=20)


def check(data):
    """A valid spec goes on to the planner (inline hardware or this host): a Plan or a clean DeploykitError."""
    try:
        spec = specfile.from_data(data)
    except SpecError as e:
        assert str(e)  # renders
        return
    try:
        planner.make_plan(spec, hardware.resolve(spec), memory.shape(spec.model))
    except DeploykitError as e:
        assert str(e)


@EXAMPLES
@given(yaml_values)
@pytest.mark.slow
def test_random_documents_never_crash(data):
    check(data)


@EXAMPLES
@given(st.text(max_size=200) | yaml_values.map(lambda v: yaml.safe_dump(v, allow_unicode=True))
       | st.builds(lambda v: yaml.safe_dump(copy.deepcopy(BASE_SPEC) | {"placement": v}), yaml_values))
@pytest.mark.slow
def test_random_yaml_text_never_crashes(text):
    try:
        check(specfile.parse_yaml(text))
    except SpecError:
        pass


FULL = make_spec(hardware={"numa_nodes": [{"id": 0, "socket": 0, "cpus": "0-7", "memory": "16GiB"}],
                           "threads_per_core": 2, "isa": ["avx512f"]},
                 placement={"strategy": "per-numa-node", "numa_nodes": [0], "reserved_cpus": 1, "use_smt": False,
                            "threads": 2, "memory_nodes": []},
                 serving={"port": 8000, "max_num_seqs": 4, "kv_cache": "1GiB", "api_key": {"env": "KEY"}},
                 image={"name": "x", "tag": "1"}, security={"seccomp": "unconfined"}, targets=["docker"])


def paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths(v, prefix + (i,))


ALL_PATHS = [p for p in paths(FULL) if p]


@EXAMPLES
@given(st.sampled_from(ALL_PATHS), yaml_values, st.sampled_from(["set", "delete", "rename"]))
@pytest.mark.slow
def test_mutations_of_a_valid_spec_never_crash(path, value, how):
    data = copy.deepcopy(FULL)
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    key = path[-1]
    if how == "set":
        parent[key] = value
    elif how == "delete":
        del parent[key]
    elif isinstance(parent, dict):
        parent[str(key) + "x"] = parent.pop(key)
    check(data)


def test_the_mutation_base_is_valid():
    assert specfile.from_data(FULL).placement.threads == 2


def test_a_bare_relative_model_source_is_relative_to_the_spec_not_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir("/")
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump(make_spec(model={"source": "tiny"})))
    assert specfile.load(f).model.source == str(tmp_path / "tiny")  # absolute, even though it does not exist
    f.write_text(yaml.safe_dump(make_spec(model={"source": "Qwen/Qwen3-8B"})))
    assert specfile.load(f).model.source == "Qwen/Qwen3-8B"  # a hub id stays an id


def test_misspelt_form_keys_get_did_you_mean_for_the_form_they_meant():
    p = problems(make_spec(hardware={"sysroott": "/snap"}))["hardware.sysroott"]
    assert "did you mean `sysroot`" in p.hint and p.allowed == "sysroot"
    p = problems(make_spec(serving={"api_key": {"secrett": "llm-key"}}))["serving.api_key.secrett"]
    assert "did you mean `secret`" in p.hint and "secret" in p.allowed
    p = problems(make_spec(hardware="autoo"))["hardware"]
    assert "did you mean `auto`" in p.hint


def test_shape_numbers_that_would_divide_by_zero_are_spec_errors():
    arch = {"num_hidden_layers": 2, "num_key_value_heads": 1, "hidden_size": 1, "num_attention_heads": 2,
            "num_parameters": 1000}
    p = problems(make_spec(model={"source": "a/b", "architecture": arch}))["model.architecture"]
    assert "head_dim of 0" in p.message


def test_huge_cpu_ranges_are_rejected_without_expanding_them():
    p = problems(make_spec(placement={"strategy": "explicit", "cpus": ["0-4000000000"]}))["placement.cpus"]
    assert "out of range" in p.message


def test_error_paths_keep_field_names_that_are_also_union_tags():
    assert "hardware.sysroot" in problems(make_spec(hardware={"sysroot": 5}))
    p = problems(make_spec(serving={"api_key": {"env": "1BAD"}}))["serving.api_key.env"]
    assert p.value == "1BAD" and "environment variable name" in p.message
    assert "image.base" in problems(make_spec(image={"base": "python 3.11"}))
    assert "serving.publish_address" in problems(make_spec(serving={"publish_address": "999.1.1.1"}))
