"""The manifests target: plain Kubernetes YAML for GitOps (Argo CD, Flux, kubectl apply -k), one object per file
plus a kustomization.yaml.

The objects are the deploykit chart rendered by Helm's own engine (helm-python-sdk, no cluster) with the plan's
values, so the chart stays the one home of every Kubernetes object and the two targets cannot drift. Each object
is re-serialized (keys in template order, no Helm "# Source" comments); `helm test` hooks and NOTES are left out.
"""

from __future__ import annotations

import yaml

from .. import __version__
from ..errors import OutputError
from ..plan import Plan
from . import helm, node
from .output import File

DIR = "k8s"


def values(plan: Plan) -> dict:
    """The chart values of the helm target, plus what only a release-less install needs: a namespace object (named
    after the deployment) with Pod Security labels, and a managed-by label that does not claim Helm."""
    sec = plan.security
    level = "privileged" if sec.sys_nice or sec.seccomp == "unconfined" else "restricted"
    return {**helm.values(plan), "managedBy": "deploykit", "namespace": {"create": True, "podSecurity": level}}


def missing() -> OutputError | None:
    """Why this target cannot render here, or None: Helm's engine is an optional dependency (the kubernetes extra).
    Imported, not just looked up: an installed package whose native library fails to load is missing too."""
    try:
        import helm_python  # noqa: F401
        return None
    except ImportError:
        pass
    return OutputError("--target manifests renders the chart with Helm's engine, which is not installed",
                       path="--target", value="manifests",
                       hint="pip install 'deploykit[kubernetes]' (helm-python-sdk; no helm binary needed)")


def objects(plan: Plan) -> list[dict]:
    """Every object of the chart for this plan, in a stable order (kind, then name)."""
    if (unavailable := missing()) is not None:
        raise unavailable
    import helm_python
    try:
        with helm_python.Chart.load(str(helm.chart_dir())) as chart:
            rendered = chart.render(values=values(plan), name=plan.name, namespace=plan.name)
    except helm_python.HelmError as e:  # the chart's validateValues or schema: a plan it cannot express
        raise OutputError(f"the deploykit chart refused this plan's values: {str(e).strip()}", path="--target",
                          value="manifests", hint="see the chart's message; helm/values.yaml shows the values") from None
    out = []
    for path, text in rendered.items():
        if path.endswith("NOTES.txt") or "/templates/tests/" in path:
            continue
        out += [o for o in yaml.safe_load_all(text) if o]
    return sorted(out, key=lambda o: (o["kind"], o["metadata"]["name"]))


def file_name(obj: dict) -> str:
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def files(plan: Plan) -> list[File]:
    head = (f"# Rendered by deploykit {__version__} from the plan of \"{plan.name}\" (the deploykit chart through "
            "Helm's engine). Re-render with `deploykit render`, check with --check.\n")
    objs = objects(plan)
    out = [File(f"{DIR}/{file_name(o)}", (head + yaml.safe_dump(o, sort_keys=False, width=120)).encode())
           for o in objs]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": sorted(file_name(o) for o in objs),
        # Selectors are immutable and already exact: a label added for bookkeeping must stay out of them.
        "labels": [{"pairs": {"deploykit.io/deployment": plan.name}, "includeSelectors": False}],
    }
    out.append(File(f"{DIR}/kustomization.yaml", (head + yaml.safe_dump(kustomization, sort_keys=False)).encode()))
    return [*out, *node.files(plan)]
