"""nginx.conf for the load balancer in front of several replicas (vLLM's throughput layout: one server per node)."""

from __future__ import annotations

from ..plan import Plan
from .output import File
from .templating import template

# A replica that fails this many requests in FAIL_TIMEOUT is skipped for FAIL_TIMEOUT (passive health checks:
# open-source nginx has no active ones).
MAX_FAILS = 3
FAIL_TIMEOUT = "30s"
# Generation can run for many minutes, and a stream may pause while a long prompt is prefilled: a silent replica is
# told from a vanished one by TCP keep-alive on the upstream connections (the container's sysctls, LB_SYSCTLS in
# container.py), not by this timeout.
READ_TIMEOUT = "3600s"
# Replicas are on the same host: a connection not set up within this is to a replica that is gone; try the next.
CONNECT_TIMEOUT = "3s"
MAX_BODY = "4m"  # the engine's own request limit: a larger body would pass here and fail there


def file(plan: Plan) -> File:
    """Upstreams are replica names: compose service names and run.sh container names are the same."""
    port = plan.serving.port
    return File("nginx.conf", text(plan, [f"{r.name}:{port}" for r in plan.replicas], str(port), "/tmp").encode())


def text(plan: Plan, servers: list[str], listen: str, tmp: str, user: str | None = None) -> str:
    """`servers` as host:port; `listen` as nginx writes it (port, or address:port); `tmp` holds the pid and temp
    files. The local runtime renders its own copy (replicas on loopback ports, files in its state directory)."""
    return template("nginx.conf.j2", plan=plan, servers=servers, listen=listen, tmp=tmp, user=user,
                    max_fails=MAX_FAILS, fail_timeout=FAIL_TIMEOUT, read_timeout=READ_TIMEOUT,
                    connect_timeout=CONNECT_TIMEOUT, max_body=MAX_BODY)
