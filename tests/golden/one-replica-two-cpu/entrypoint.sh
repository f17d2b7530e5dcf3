#!/bin/sh
# Start the engine for one replica of deployment "qwen" (rendered by deploykit 0.1.0).
# The replica index comes from DEPLOYKIT_REPLICA; the engine reads that replica's CPUs, memory nodes and sizes
# from the plan and binds its OpenMP threads and memory itself (Compose and Kubernetes cannot set cpuset-mems).
# `exec` keeps the server as PID 1, so the SIGTERM of `docker stop` reaches it and in-flight requests finish.
set -eu
: "${DEPLOYKIT_REPLICA:?DEPLOYKIT_REPLICA is not set: the index of this container's replica in plan.json}"
# Every replica listens on the serving port inside its container; only the load balancer publishes a port.
exec python -m engine serve "${DEPLOYKIT_MODEL_DIR:-/model}" \
    --plan "${DEPLOYKIT_PLAN:-/etc/deploykit/plan.json}" --replica "$DEPLOYKIT_REPLICA" \
    --host 0.0.0.0 --port "${DEPLOYKIT_PORT:-8000}" "$@"
