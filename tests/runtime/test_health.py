"""What `status` reads from a replica: the two numbers from Prometheus text as prometheus_client writes it (the
engine's library), and the engine's binding report turned into CPUs and memory nodes."""

from __future__ import annotations

import json
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deploykit.binding_report import BindingReport, FrontendReport, MemoryPolicy
from deploykit.runtime import health
from tests.binding_reports import engine_report


def test_metrics_sum_label_sets_and_skip_comments():
    r = CollectorRegistry()
    Gauge("deploykit_num_requests_running", "running", ["model_name"], registry=r).labels("m").set(3)
    tokens = Counter("deploykit_generation_tokens", "tokens", ["model_name"], registry=r)
    tokens.labels("m").inc(40)
    tokens.labels("other{weird}").inc(2)
    Histogram("deploykit_e2e_request_latency_seconds", "e2e", ["model_name"], registry=r).labels("m").observe(0.5)
    parsed = health.parse_metrics(generate_latest(r).decode())
    assert parsed["deploykit_num_requests_running"] == 3
    assert parsed["deploykit_generation_tokens_total"] == 42
    assert parsed["deploykit_e2e_request_latency_seconds_count"] == 1


def test_engine_cpus_are_the_openmp_workers_and_mems_the_policy():
    engine = engine_report(["2", "3"], cores=("0", "1", "2", "3", "4", "5", "6", "7"), other_cpus="0-7",
                           mems_allowed=(0, 1), memory_policy=MemoryPolicy("bind", (1,)))
    report = BindingReport(engine, FrontendReport(1, (0, 1)))
    assert health.engine_cpus(report) == "2-3"
    assert health.engine_mems(report) == "1 (bind)"
    report = BindingReport(replace(engine, memory_policy=MemoryPolicy("default")), report.frontend)
    assert health.engine_mems(report) == "unbound (0-1 allowed)"


def test_a_binding_answer_reads_back_typed_and_anything_else_is_none():
    report = BindingReport(engine_report(["2", "3"], cores=("2", "3")), FrontendReport(1, (2, 3)))
    assert health.binding(health.Answer(200, json.dumps(report.to_dict()).encode())) == report
    assert health.binding(health.Answer(200, b'{"engine": {"error": "RuntimeError: x"}, "frontend": {}}')) is None
    assert health.binding(health.Answer(401, b"{}")) is None


def test_no_answer_is_described_not_raised():
    a = health.get("http://127.0.0.1:1/health", timeout=1)
    assert a.status == 0 and health.describe(a).startswith("no answer")
