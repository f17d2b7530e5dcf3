"""What a running replica says about itself over HTTP: /health, the engine's /debug/binding report, and the two
numbers `status` shows from /metrics (requests running, tokens per second). A runtime fetches the answers (over
loopback, or inside a container whose network has no way in from the host); this module reads them.

Plain urllib: these are a handful of GETs on loopback, and deploykit's core has no HTTP client dependency.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from .. import cpulist
from ..binding_report import BindingReport
from ..errors import DeploykitError


@dataclass(frozen=True, slots=True)
class Answer:
    status: int  # 0: no HTTP answer at all (refused, reset, timed out)
    body: bytes
    error: str = ""  # why there was no answer

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


def get(url: str, *, timeout: float = 3.0, api_key: str | None = None) -> Answer:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Answer(r.status, r.read())
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return Answer(0, b"", str(getattr(reason, "strerror", None) or reason))


HEALTH_TIMEOUT, REPORT_TIMEOUT = 2.0, 5.0


def describe(a: Answer) -> str:
    """A /health answer in a word or two: healthy, loading (503), no answer (connection refused)."""
    if a.status == 200:
        return "healthy"
    if a.status == 503:
        return "unavailable (503: loading, draining or engine down)"
    if a.status:
        return f"HTTP {a.status}"
    return f"no answer ({a.error})" if a.error else "no answer"


def binding(a: Answer) -> BindingReport | None:
    """The engine's binding report from GET /debug/binding (which needs the API key when the deployment has one);
    None when there is none to read (an error answer, an engine that failed to build it, another server)."""
    if a.status != 200:
        return None
    try:
        return BindingReport.from_dict(json.loads(a.body))
    except (ValueError, DeploykitError):
        return None


def metrics(a: Answer) -> dict[str, float] | None:
    """GET /metrics, parsed."""
    return parse_metrics(a.text) if a.status == 200 else None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {metric name: sum over its label sets}. Hand-written: status reads two plain
    gauges/counters, and prometheus_client is a dependency of the engine, not of deploykit's CLI."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[:line.index("{")], line[line.rindex("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        out[name.strip()] = out.get(name.strip(), 0.0) + value
    return out


def engine_cpus(report: BindingReport) -> str | None:
    """The CPUs the engine's OpenMP workers are really allowed on (union), from its binding report."""
    cpus = {c for t in report.engine.omp for c in t.allowed_cpus}
    return cpulist.format(cpus) if cpus else None


def engine_mems(report: BindingReport) -> str:
    policy = report.engine.memory_policy
    if policy.error is not None:
        return f"? ({policy.error})"
    if policy.mode in (None, "default") or not policy.nodes:
        return f"unbound ({cpulist.format(report.engine.mems_allowed)} allowed)"
    return f"{cpulist.format(policy.nodes)} ({policy.mode})"
