"""The deploykit Helm chart, rendered and linted by Helm v4's own engine (helm-python-sdk, no cluster), every object
validated strictly against the Kubernetes 1.33 schemas, and the policies every rendered pod must meet."""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import yaml

if os.environ.get("DEPLOYKIT_REQUIRE_DOCKER") == "1":  # CI installs the kubernetes extra: never a silent skip
    import helm_python as helm
    import kubernetes_validate as kv
else:
    helm = pytest.importorskip("helm_python", reason="pip install 'deploykit[kubernetes]'")
    kv = pytest.importorskip("kubernetes_validate")

from deploykit.binding_report import BindingReport, FrontendReport, MemoryPolicy  # noqa: E402
from deploykit.render import seccomp  # noqa: E402
from deploykit.render.helm import chart_dir  # noqa: E402
from tests import policies  # noqa: E402
from tests.binding_reports import engine_report  # noqa: E402

CHART = chart_dir()
KUBE = "1.33.0"
CI = sorted((CHART / "ci").glob("*-values.yaml"))
# CRDs kubernetes-validate has no schema for; their fields are checked by the tests below instead.
CRDS = {("security-profiles-operator.x-k8s.io/v1beta1", "SeccompProfile"), ("monitoring.coreos.com/v1",
                                                                             "ServiceMonitor")}
REQUIRED = {"model": {"pvc": {"claimName": "models"}}}


def render(values: dict | None = None, name: str = "rel", namespace: str = "llm") -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values=values if values is not None else REQUIRED, name=name, namespace=namespace)


def objects(rendered: dict[str, str], tests: bool = True) -> list[dict]:
    return [o for path, text in sorted(rendered.items()) if not path.endswith("NOTES.txt")
            and (tests or "/tests/" not in path) for o in yaml.safe_load_all(text) if o]


def pod_specs(objs: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for o in objs:
        if o["kind"] == "Deployment":
            out.append((o["metadata"]["name"], o["spec"]["template"]["spec"]))
        elif o["kind"] == "Pod":
            out.append((o["metadata"]["name"], o["spec"]))
    return out


CASES = {"defaults": REQUIRED, **{p.name: yaml.safe_load(p.read_text()) for p in CI}}


def test_there_are_at_least_four_ci_permutations():
    assert len(CI) >= 4


@pytest.mark.parametrize("case", sorted(CASES))
def test_helm_lint_strict_is_clean(case):
    report = helm.lint(str(CHART), CASES[case], strict=True, namespace="llm", kube_version=f"v{KUBE}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_object_validates_strictly_against_kubernetes_1_33(case):
    checked = 0
    for o in objects(render(CASES[case])):
        if (o["apiVersion"], o["kind"]) in CRDS:
            continue
        kv.validate(o, KUBE, strict=True)
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_pod_meets_the_policies(case):
    values = CASES[case]
    objs = objects(render(values))
    pods = pod_specs(objs)
    assert len([p for p in pods if not p[0].endswith("-test-placement")]) == len(
        values.get("placement", {}).get("slots", [1]))
    for name, spec in pods:
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] >= 10000 and psc["runAsGroup"] >= 10000, name
        assert psc["seccompProfile"]["type"] != "Unconfined", name
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"]:
            sc, res = c["securityContext"], c["resources"]
            assert c["image"].split("@")[0].rsplit(":", 1)[-1] != "latest" and (":" in c["image"] or "@" in c["image"])
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], name
            assert res["requests"] == res["limits"], name  # Guaranteed QoS
            if name.endswith("-test-placement"):
                continue
            cpus = int(res["limits"]["cpu"])  # an integer count: exclusive CPUs under the static policy
            assert str(cpus) == res["limits"]["cpu"] and cpus % values.get("placement", {}).get("threadsPerCore", 2) == 0
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["httpGet"]["path"] == "/health", (name, probe)
            startup = c["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model load is not a failure
            env = {e["name"] for e in c.get("env", [])}
            assert not env & {"DEPLOYKIT_FRONTEND_CPUS", "DEPLOYKIT_MEMS", "GOMP_CPU_AFFINITY", "OMP_PLACES"}
    # Pod Security Standard "restricted" for the Localhost/RuntimeDefault cases (every CI case here).
    assert all(spec["securityContext"]["seccompProfile"]["type"] in ("Localhost", "RuntimeDefault")
               for _, spec in pods)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_pdb_and_services_select_exactly_the_engine_pods(case):
    objs = objects(render(CASES[case]), tests=False)
    templates = [o["spec"]["template"]["metadata"]["labels"] for o in objs if o["kind"] == "Deployment"]
    for o in objs:
        if o["kind"] == "PodDisruptionBudget":
            sel = o["spec"]["selector"]["matchLabels"]
        elif o["kind"] == "Service":
            sel = o["spec"]["selector"]
        else:
            continue
        assert sel and all(sel.items() <= t.items() for t in templates), o["metadata"]["name"]
    for o in objs:
        if o["kind"] == "Deployment":  # each Deployment selects its own slot's pods and no other slot's
            sel = o["spec"]["selector"]["matchLabels"]
            assert [t for t in templates if sel.items() <= t.items()] == [o["spec"]["template"]["metadata"]["labels"]]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_engine_pod_is_denied_by_default_and_the_test_pod_reaches_it(case):
    values = CASES[case]
    objs = objects(render(values))
    np = values.get("networkPolicy", {})
    egress = list(np.get("egress", {}).get("rules", []))
    if np.get("egress", {}).get("dns"):
        egress.insert(0, DNS_RULE)
    assert policies.check_engine_pods(objs, egress, np.get("metricsNamespace", "")) == len(
        values.get("placement", {}).get("slots", [1]))
    pods = {labels["app.kubernetes.io/component"]: labels for _, labels, _ in policies.pod_templates(objs)}
    (engine_policy,) = policies.policies_of(objs, pods["engine"])
    api_from = engine_policy["spec"]["ingress"][0]["from"]
    assert ({"podSelector": {}} in api_from) is np.get("fromNamespace", True)
    assert all(peer in api_from for peer in np.get("ingressFrom", []))
    (own,) = policies.policies_of(objs, pods["test"])  # the `helm test` pod's own policy
    assert own["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert own["spec"]["policyTypes"] == ["Ingress", "Egress"] and own["spec"]["ingress"] == []
    to_engine, to_dns = own["spec"]["egress"]
    assert policies.selects(to_engine["to"][0]["podSelector"], pods["engine"])
    assert to_engine["ports"] == [{"port": values.get("engine", {}).get("port", 8000), "protocol": "TCP"}]
    assert to_dns == DNS_RULE
    # ... and the engine's policy admits the test pod to the API port, whatever fromNamespace says.
    assert any("podSelector" in peer and policies.selects(peer["podSelector"], pods["test"]) for peer in api_from)


DNS_RULE = {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
            "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}


def test_the_network_policy_can_be_switched_off_and_the_notes_warn():
    out = render({**REQUIRED, "networkPolicy": {"enabled": False}})
    assert not [o for o in objects(out) if o["kind"] == "NetworkPolicy"]
    assert "WARNING: networkPolicy.enabled is false" in out["deploykit/templates/NOTES.txt"]
    notes = render()["deploykit/templates/NOTES.txt"]
    assert "NetworkPolicy rel-deploykit: the API port admits pods of namespace llm" in notes
    assert "no connection at all" in notes


def test_prometheus_scrapes_a_metrics_port_of_its_own():
    values = CASES["two-numa-slots-values.yaml"]
    objs = objects(render(values), tests=False)
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    assert cm["data"]["DEPLOYKIT_METRICS_PORT"] == "9400"
    (sm,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    (svc,) = [o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "qwen3-8b"]
    assert {"name": "metrics", "port": 9400, "targetPort": "metrics", "protocol": "TCP"} in svc["spec"]["ports"]
    no_namespace = copy.deepcopy(values)
    del no_namespace["networkPolicy"]["metricsNamespace"]
    with pytest.raises(helm.HelmError, match="networkPolicy.metricsNamespace: required"):
        render(no_namespace)
    with pytest.raises(helm.HelmError, match="metrics.port: 8000 is engine.port too"):
        render({**REQUIRED, "metrics": {"port": 8000}})


def test_no_host_cpu_ids_reach_the_pods():
    objs = objects(render(CASES["two-numa-slots-values.yaml"]))
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-engine")]
    assert cm["data"]["DEPLOYKIT_CPUS"] == "auto" and cm["data"]["DEPLOYKIT_RESERVED_CPUS"] == "1"
    assert not {"DEPLOYKIT_FRONTEND_CPUS", "DEPLOYKIT_MEMS"} & set(cm["data"])
    dep = next(o for o in objs if o["kind"] == "Deployment")
    assert dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    affinity = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    (term,) = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {e["key"] for e in term["matchExpressions"]} >= {"feature.node.kubernetes.io/cpu-cpuid.AVX512F",
                                                           "feature.node.kubernetes.io/cpu-cpuid.AVX512BF16"}
    res = dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert res == {"cpu": "190", "memory": "343637Mi"}  # (96 cores - 1 left to the kubelet) x 2 siblings


def test_config_change_changes_the_checksum_and_nothing_else_moves():
    a = objects(render(CASES["two-numa-slots-values.yaml"]))
    changed = copy.deepcopy(CASES["two-numa-slots-values.yaml"])
    changed["engine"]["maxNumSeqs"] = 32
    b = objects(render(changed))
    sums = [{o["metadata"]["name"]: o["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
             for o in objs if o["kind"] == "Deployment"} for objs in (a, b)]
    assert sums[0].keys() == sums[1].keys() and all(sums[0][k] != sums[1][k] for k in sums[0])
    assert render(CASES["two-numa-slots-values.yaml"]) == render(CASES["two-numa-slots-values.yaml"])


def test_seccomp_profile_object_and_node_file_are_deploykits_flattened_profile():
    flat = seccomp.flatten_for_oci(seccomp.profile())
    assert (CHART / "files" / "seccomp-engine.json").read_bytes() == seccomp.dumps(flat)
    (sp,) = [o for o in objects(render()) if o["kind"] == "SeccompProfile"]
    assert sp["spec"]["syscalls"] == flat["syscalls"] and sp["spec"]["architectures"] == flat["architectures"]
    allowed = {n for r in sp["spec"]["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" for n in r["names"]}
    assert {"set_mempolicy", "mbind", "migrate_pages", "move_pages", "get_mempolicy"} <= allowed
    assert not {"mount", "unshare", "ptrace", "bpf", "kexec_load"} & allowed
    (dep,) = [o for o in objects(render()) if o["kind"] == "Deployment"]
    assert dep["spec"]["template"]["spec"]["securityContext"]["seccompProfile"] == {
        "type": "Localhost", "localhostProfile": f"operator/{sp['metadata']['name']}.json"}


def test_unconfined_and_sys_nice_only_when_asked_and_the_notes_warn():
    out = render({**REQUIRED, "seccomp": {"type": "Unconfined"}, "security": {"sysNice": True}})
    (dep,) = [o for o in objects(out) if o["kind"] == "Deployment"]
    spec = dep["spec"]["template"]["spec"]
    assert spec["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    assert spec["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_NICE"]}
    assert not [o for o in objects(out) if o["kind"] == "SeccompProfile"]
    notes = out["deploykit/templates/NOTES.txt"]
    assert "WARNING: seccomp.type is Unconfined" in notes and "fail the Pod Security Standards" in notes
    notes = render({**REQUIRED, "seccomp": {"type": "RuntimeDefault"}})["deploykit/templates/NOTES.txt"]
    assert "cannot bind its memory" in notes


def test_namespace_carries_pod_security_restricted_labels():
    (ns,) = [o for o in objects(render({**REQUIRED, "namespace": {"create": True}})) if o["kind"] == "Namespace"]
    labels = ns["metadata"]["labels"]
    assert ns["metadata"]["name"] == "llm"
    assert {labels[f"pod-security.kubernetes.io/{m}"] for m in ("enforce", "audit", "warn")} == {"restricted"}


@pytest.mark.parametrize("values, needle", [
    ({"image": {"tag": "latest"}}, "image.tag"),
    ({"placement": {"threadsPerCore": 2, "slots": [{"name": "0", "cores": "many", "memory": "8Gi"}]}},
     "/placement/slots/0/cores"),
    ({"placement": {"threadsPerCore": 3, "slots": [{"name": "0", "cores": 4, "memory": "8Gi"}]}},
     "/placement/threadsPerCore"),
    ({"seccomp": {"type": "Off"}}, "/seccomp/type"),
    ({"security": {"runAsUser": 1000}}, "/security/runAsUser"),
    ({"engine": {"maxNumSeqs": 16, "bogus": 1}}, "bogus"),
    ({"placement": {"threadsPerCore": 2, "slots": [{"name": "0", "cores": 4, "memory": "lots"}]}},
     "/placement/slots/0/memory"),
])
def test_values_violating_the_schema_are_rejected_with_the_key_named(values, needle):
    merged = {**REQUIRED, **values}
    with pytest.raises(helm.HelmError) as err:
        render(merged)
    assert needle in str(err.value), str(err.value)


def test_every_semantic_problem_is_reported_at_once():
    bad = {"model": {"source": "hostPath"}, "hugepages": {"enabled": True},
           "placement": {"threadsPerCore": 2, "coresLeftToKubelet": 1,
                         "slots": [{"name": "0", "cores": 1, "memory": "8Gi"}, {"name": "0", "cores": 4,
                                                                                 "memory": "8Gi"}]},
           "namespace": {"create": True}, "security": {"sysNice": True}}
    with pytest.raises(helm.HelmError) as err:
        render(bad)
    text = str(err.value)
    for needle in ("5 problem(s)", "model.hostPath.path", "hugepages.amount", "leaves no core", "used twice",
                   "security.sysNice"):
        assert needle in text, text


def _check_module():
    spec = importlib.util.spec_from_file_location("placement_check", CHART / "files" / "placement_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_helm_test_check_passes_a_pod_pinned_one_thread_per_core():
    check = _check_module().check
    assert check(engine_report(["8", "9", "10"], "11,203"), use_smt=False, reserved=None, threads=None) == []
    assert check(engine_report(["8", "200", "9", "201", "10", "202"], "11,203"), use_smt=True, reserved=1,
                 threads=None) == []
    # Below 4 cores the front end shares the inference cores (deploykit.placement's default), and reads so
    assert check(engine_report(["8", "9"], cores=("8,200", "9,201")), use_smt=False, reserved=None,
                 threads=None) == []


@pytest.mark.parametrize("report, needle", [
    (engine_report(["8", "200", "9"], "11,203"), "share a physical core"),
    (engine_report(["8-11"], "11,203"), "not pinned to a single CPU"),
    (engine_report(["8", "9"], "11,203"), "2 OpenMP threads for 4 physical cores"),
    (engine_report(["8", "9", "11"], "11,203"), "front end's cores also run"),
    (engine_report(["8", "9", "10"], ""), "the front end holds 0 core(s), expected 1"),
    (engine_report(["8", "9", "10"], "11,203", memory_policy=MemoryPolicy("default")), "memory is not bound"),
    (engine_report(["8", "9", "10"], "11,203", warnings=("migrate_pages refused",)), "binding warning"),
])
def test_helm_test_check_fails_a_badly_pinned_pod(report, needle):
    problems = _check_module().check(report, use_smt=False, reserved=None, threads=None)
    assert any(needle in p for p in problems), problems


def test_helm_test_check_reads_the_report_as_the_engine_writes_it():
    """The check parses /debug/binding with deploykit's own type: the JSON form reads back to the same report."""
    report = engine_report(["8", "9", "10"], "11,203")
    assert BindingReport.from_dict(BindingReport(report, FrontendReport(1, (11, 203))).to_dict()).engine == report


def test_a_slot_can_leave_the_kubelet_nothing_so_its_pod_requests_whole_l3_groups():
    values = CASES["l3-slots-values.yaml"]
    objs = objects(render(values), tests=False)
    cpu = {o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]
           for o in objs if o["kind"] == "Deployment"}
    assert cpu == {"qwen3-8b-l3-0": "16", "qwen3-8b-l3-1": "16", "qwen3-8b-l3-2": "14"}
    bad = copy.deepcopy(values)
    bad["placement"]["slots"][0]["coresLeftToKubelet"] = 8
    with pytest.raises(helm.HelmError, match=r"placement.slots\[0\].cores: 8 minus coresLeftToKubelet 8 leaves no "
                                             r"core"):
        render(bad)
