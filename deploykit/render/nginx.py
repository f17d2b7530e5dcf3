"""nginx.conf for the load balancer in front of several replicas (vLLM's throughput layout: one server per node)."""

from __future__ import annotations

from ..plan import Plan
from .output import File
from .templating import template

# A replica that fails this many requests in FAIL_TIMEOUT is skipped for FAIL_TIMEOUT (passive health checks:
# open-source nginx has no active ones).
MAX_FAILS = 3
FAIL_TIMEOUT = "30s"
# Generation can run for many minutes, and a stream may pause while a long prompt is prefilled.
READ_TIMEOUT = "3600s"
MAX_BODY = "4m"  # the engine's own request limit: a larger body would pass here and fail there


def file(plan: Plan) -> File:
    """Upstreams are replica names: compose service names and run.sh container names are the same."""
    text = template("nginx.conf.j2", plan=plan, servers=[r.name for r in plan.replicas], max_fails=MAX_FAILS,
                    fail_timeout=FAIL_TIMEOUT, read_timeout=READ_TIMEOUT, max_body=MAX_BODY)
    return File("nginx.conf", text.encode())
