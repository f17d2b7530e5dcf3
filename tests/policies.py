"""What every rendered engine pod must meet on the network, checked over a list of Kubernetes objects (the chart's
output or the manifests target's files): deny by default, the API and metrics ports only, and no egress."""

from __future__ import annotations

ENGINE_PORTS = {"http", "metrics"}  # the engine container's named ports


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector against a pod's labels (the chart writes matchLabels only)."""
    assert not selector.get("matchExpressions"), selector
    return selector.get("matchLabels", {}).items() <= labels.items()


def pod_templates(objs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(name, labels, pod spec) of every pod a Deployment makes and every bare Pod (the `helm test` pod)."""
    out = []
    for o in objs:
        if o["kind"] == "Deployment":
            tpl = o["spec"]["template"]
            out.append((o["metadata"]["name"], tpl["metadata"]["labels"], tpl["spec"]))
        elif o["kind"] == "Pod":
            out.append((o["metadata"]["name"], o["metadata"]["labels"], o["spec"]))
    return out


def policies_of(objs: list[dict], labels: dict) -> list[dict]:
    return [o for o in objs if o["kind"] == "NetworkPolicy" and selects(o["spec"]["podSelector"], labels)]


def check_engine_pods(objs: list[dict], egress: list | None = None, metrics_namespace: str = "") -> int:
    """Every engine pod is selected by exactly one NetworkPolicy that governs ingress and egress, admits only the
    API port (from listed peers, never from everyone) and the metrics port (only from `metrics_namespace`), and
    allows `egress` (default: nothing). Returns how many engine pod templates were checked."""
    checked = 0
    for name, labels, spec in pod_templates(objs):
        if labels.get("app.kubernetes.io/component") != "engine":
            continue
        (np,) = policies_of(objs, labels) or [None]
        assert np is not None, f"{name}: no NetworkPolicy selects it"
        rules = np["spec"]
        assert rules["policyTypes"] == ["Ingress", "Egress"], name
        named = {p["name"] for c in spec["containers"] for p in c.get("ports", [])}
        assert named == ENGINE_PORTS, named
        ports = []
        for rule in rules["ingress"]:
            assert rule.get("from"), f"{name}: an ingress rule without `from` admits every source"
            rule_ports = [p["port"] for p in rule["ports"]]
            assert set(rule_ports) <= ENGINE_PORTS and all(p["protocol"] == "TCP" for p in rule["ports"]), rule
            if rule_ports == ["metrics"]:
                assert rule["from"] == [{"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": metrics_namespace}}}], rule
            ports += rule_ports
        assert ports.count("http") == 1 and ports.count("metrics") == (1 if metrics_namespace else 0), ports
        assert rules["egress"] == (egress or []), (name, rules["egress"])
        checked += 1
    return checked
