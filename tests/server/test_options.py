"""`serve` options: explicit flags over the plan's replica over DEPLOYKIT_* environment over defaults."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from engine.errors import OptionsError
from engine.server.options import ServeOptions, add_arguments, options_from_args
from tests import plans

PLAN = plans.make_plan([plans.replica(0, [0, 1, 2], [3], [0], kv_cache_bytes=1 << 30),
                        plans.replica(1, [4, 5], [], [1], kv_cache_bytes=2 << 30)],
                       dtype="bfloat16", max_model_len=4096, served_name="Qwen/Qwen3-8B", max_num_seqs=32,
                       max_num_batched_tokens=4096, api_key_env="MY_KEY")


def options(*argv: str, env: dict | None = None) -> ServeOptions:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return options_from_args(p.parse_args(["/model", *argv]), env or {})


@pytest.fixture
def plan(tmp_path) -> str:
    return plans.write(PLAN, tmp_path / "plan.json")


def test_defaults_without_plan_or_environment():
    o = options()
    assert (o.host, o.port, o.binding, o.frontend_cpus, o.api_key, o.model_name) == ("127.0.0.1", 8000, "auto", None,
                                                                                   None, "model")
    assert o.engine_config().max_num_seqs == 16


def test_plan_replica_fills_everything(plan):
    o = options("--plan", plan, "--replica", "1", env={"MY_KEY": "s3cret"})
    assert (o.binding, o.binding_source, o.frontend_cpus, o.mems) == ((4, 5), "plan", (), (1,))
    assert (o.dtype, o.max_model_len, o.served_model_name, o.kv_cache_bytes) == ("bfloat16", 4096,
                                                                                 "Qwen/Qwen3-8B", 2 << 30)
    assert (o.max_num_seqs, o.max_num_batched_tokens, o.api_key) == (32, 4096, "s3cret")
    assert "s3cret" not in repr(o)


def test_flags_override_the_plan(plan):
    o = options("--plan", plan, "--binding", "7", "--mems", "0", "--max-num-seqs", "2", "--kv-cache", "1GiB",
                "--served-model-name", "x", "--api-key", "k", env={"MY_KEY": "s3cret"})
    assert (o.binding, o.binding_source, o.frontend_cpus, o.mems) == ((7,), "explicit", (3,), (0,))
    assert (o.max_num_seqs, o.kv_cache_bytes, o.served_model_name, o.api_key) == (2, 1 << 30, "x", "k")


def test_environment_is_the_fallback():
    o = options(env={"DEPLOYKIT_CPUS": "2-3", "DEPLOYKIT_FRONTEND_CPUS": "1", "DEPLOYKIT_MEMS": "0",
                     "DEPLOYKIT_API_KEY": "envkey"})
    assert (o.binding, o.binding_source, o.frontend_cpus, o.mems, o.api_key) == ((2, 3), "env", (1,), (0,), "envkey")


def test_plan_errors_are_clear(plan, tmp_path):
    with pytest.raises(OptionsError, match=r"requires an API key in \$MY_KEY"):
        options("--plan", plan)
    with pytest.raises(OptionsError, match="has 2 replica"):
        options("--plan", plan, "--replica", "5", env={"MY_KEY": "k"})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(OptionsError, match="not JSON"):
        options("--plan", str(tmp_path / "bad.json"))
    (tmp_path / "partial.json").write_text('{"apiVersion": "deploykit/v1", "kind": "Plan", "name": "x"}')
    with pytest.raises(OptionsError, match="model: missing from the plan"):
        options("--plan", str(tmp_path / "partial.json"))
    with pytest.raises(OptionsError, match="cannot read plan"):
        options("--plan", str(tmp_path / "absent.json"))


def test_environment_carries_every_setting_a_pod_needs():
    """A Kubernetes pod gets its settings from a ConfigMap as DEPLOYKIT_* variables and binds with `auto`."""
    o = options(env={"DEPLOYKIT_CPUS": "auto", "DEPLOYKIT_RESERVED_CPUS": "2", "DEPLOYKIT_USE_SMT": "true",
                     "DEPLOYKIT_THREADS": "8", "DEPLOYKIT_DTYPE": "bfloat16", "DEPLOYKIT_MAX_MODEL_LEN": "4096",
                     "DEPLOYKIT_MAX_NUM_SEQS": "32", "DEPLOYKIT_MAX_NUM_BATCHED_TOKENS": "1024",
                     "DEPLOYKIT_KV_CACHE": "2GiB", "DEPLOYKIT_SERVED_MODEL_NAME": "qwen",
                     "DEPLOYKIT_METRICS_PORT": "9400"})
    assert (o.binding, o.binding_source, o.reserved_cpus, o.use_smt, o.threads) == ("auto", None, 2, True, 8)
    assert (o.dtype, o.max_model_len, o.max_num_seqs, o.max_num_batched_tokens) == ("bfloat16", 4096, 32, 1024)
    assert (o.kv_cache_bytes, o.model_name, o.metrics_port) == (2 << 30, "qwen", 9400)
    assert options("--max-num-seqs", "4", env={"DEPLOYKIT_MAX_NUM_SEQS": "32"}).max_num_seqs == 4  # flags win


@pytest.mark.parametrize("var, value, needle", [("DEPLOYKIT_MAX_MODEL_LEN", "lots", "DEPLOYKIT_MAX_MODEL_LEN"),
                                                ("DEPLOYKIT_USE_SMT", "maybe", "DEPLOYKIT_USE_SMT"),
                                                ("DEPLOYKIT_RESERVED_CPUS", "-1", "--reserved-cpus must be"),
                                                ("DEPLOYKIT_KV_CACHE", "big", "DEPLOYKIT_KV_CACHE"),
                                                ("DEPLOYKIT_METRICS_PORT", "0", "--metrics-port must be")])
def test_bad_environment_settings_are_named(var, value, needle):
    with pytest.raises(OptionsError, match=needle):
        options(env={var: value})


@pytest.mark.parametrize("argv, env, needle", [
    (["--binding", "zero"], {}, "--binding 'zero': must be auto, none or a CPU list"),
    (["--binding", ""], {}, "not empty"),
    (["--mems", "0-"], {}, "--mems '0-'"),
    ([], {"DEPLOYKIT_CPUS": "first"}, r"\$DEPLOYKIT_CPUS='first' is not valid: must be auto, none or a CPU list"),
    ([], {"DEPLOYKIT_FRONTEND_CPUS": "3-1"}, "DEPLOYKIT_FRONTEND_CPUS"),
])
def test_cpu_lists_are_parsed_at_the_edge_and_bad_ones_named(argv, env, needle):
    with pytest.raises(OptionsError, match=needle):
        options(*argv, env=env)


def test_binding_auto_over_a_plan_drops_the_plans_host_cpu_ids(plan):
    o = options("--plan", plan, "--binding", "auto", "--reserved-cpus", "1", env={"MY_KEY": "k"})
    assert (o.binding, o.binding_source, o.frontend_cpus, o.mems, o.reserved_cpus) == ("auto", None, None, None, 1)
    assert o.kv_cache_bytes == 1 << 30  # sizes still come from the plan


def test_prefix_caching_is_on_unless_a_flag_the_environment_or_the_plan_turns_it_off(tmp_path):
    assert options().engine_config().prefix_caching is True
    assert options("--no-prefix-caching").engine_config().prefix_caching is False
    assert options(env={"DEPLOYKIT_PREFIX_CACHING": "0"}).prefix_caching is False
    off = plans.write(dataclasses.replace(PLAN, serving=dataclasses.replace(PLAN.serving, prefix_caching=False)),
                      tmp_path / "plan.json")
    assert options("--plan", off, env={"MY_KEY": "k"}).prefix_caching is False
    assert options("--plan", off, "--prefix-caching", env={"MY_KEY": "k"}).prefix_caching is True


def test_compact_weights_are_on_unless_a_flag_or_the_environment_turns_them_off(plan):
    assert options().engine_config().compact_weights is True
    assert options("--no-compact-weights").engine_config().compact_weights is False
    assert options(env={"DEPLOYKIT_COMPACT_WEIGHTS": "0"}).compact_weights is False
    # a plan does not hold it: a container's environment sets it with one, and a flag wins over both
    assert options("--plan", plan, env={"MY_KEY": "k", "DEPLOYKIT_COMPACT_WEIGHTS": "0"}).compact_weights is False
    assert options("--compact-weights", env={"DEPLOYKIT_COMPACT_WEIGHTS": "0"}).compact_weights is True


def test_parsers_come_from_flags_or_the_environment_with_or_without_a_plan(plan):
    assert (options().tool_call_parser, options().reasoning_parser) == ("auto", "auto")
    o = options("--tool-call-parser", "llama3_json", "--reasoning-parser", "none")
    assert (o.tool_call_parser, o.reasoning_parser) == ("llama3_json", "none")
    env = {"MY_KEY": "k", "DEPLOYKIT_TOOL_CALL_PARSER": "hermes", "DEPLOYKIT_REASONING_PARSER": "deepseek_r1"}
    o = options("--plan", plan, env=env)  # a plan holds neither: a container sets them in its environment
    assert (o.tool_call_parser, o.reasoning_parser) == ("hermes", "deepseek_r1")
    with pytest.raises(OptionsError, match="DEPLOYKIT_REASONING_PARSER.*one of auto, none"):
        options(env={"DEPLOYKIT_REASONING_PARSER": "think"})
    with pytest.raises(SystemExit):  # argparse names the choices
        options("--tool-call-parser", "mistral")
