#!/usr/bin/env bash
# Run deployment "qwen" with plain `docker run`: 1 engine replica.
# Rendered by deploykit 0.1.0 from plan.json; edit the spec and re-render rather than this file.
#
#   ./build.sh                           build the image first
#   MODEL_FILE=/path/to/model.gguf ./run.sh    start; re-running replaces this deployment's containers
#   ./run.sh down                        stop and remove them
# Env: MODEL_FILE (the model file on this host, mounted read-only at /model/tiny.Q8_0.gguf), IMAGE (default
# deploykit-engine:0.1.0), DOCKER (default docker).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
IMAGE="${IMAGE:-deploykit-engine:0.1.0}"
DOCKER="${DOCKER:-docker}"
DEPLOYMENT=qwen

# Remove a container of this deployment; refuse to touch a same-named container that is not ours.
replace() {
    local owner
    if owner="$("$DOCKER" inspect --format '{{index .Config.Labels "deploykit.deployment"}}' "$1" 2>/dev/null)"; then
        if [ "$owner" != "$DEPLOYMENT" ]; then
            echo "run.sh: a container named $1 exists and does not belong to deployment $DEPLOYMENT" >&2
            exit 1
        fi
        "$DOCKER" stop "$1" >/dev/null  # SIGTERM, then the container's own stop timeout: in-flight requests finish
        "$DOCKER" rm -f "$1" >/dev/null
    fi
}

if [ "${1:-up}" = down ]; then
    ids="$("$DOCKER" ps -aq --filter "label=deploykit.deployment=$DEPLOYMENT")"
    # docker stop, not rm -f: each container gets its stop signal and grace period (engines drain, nginx
    # finishes the streams it proxies), all at once.
    [ -z "$ids" ] || { "$DOCKER" stop $ids >/dev/null; "$DOCKER" rm -f $ids >/dev/null; }
    exit 0
fi
MODEL_FILE="${MODEL_FILE:-/spec/tiny.Q8_0.gguf}"

# replica 0 on NUMA node 0: inference CPUs 0-1 (2 OpenMP threads), front end shares those CPUs; memory on node 0, limit 2.0 GiB
replace qwen-0
"$DOCKER" run --detach \
    --name qwen-0 \
    --label deploykit.deployment=qwen \
    --label deploykit.replica=0 \
    --restart unless-stopped \
    --stop-timeout 50 \
    --cpuset-cpus 0-1 \
    --cpuset-mems 0 \
    --memory 2152541888 \
    --memory-swap 2152541888 \
    --shm-size 256m \
    --user 10001:10001 \
    --read-only \
    --tmpfs /tmp:rw,nosuid,nodev,size=1g \
    --cap-drop ALL \
    --security-opt no-new-privileges \
    --security-opt "seccomp=$HERE/seccomp.json" \
    --env DEPLOYKIT_CPUS=0-1 \
    --env DEPLOYKIT_FRONTEND_CPUS= \
    --env DEPLOYKIT_MEMS=0 \
    --env DEPLOYKIT_REPLICA=0 \
    --env OMP_NUM_THREADS=2 \
    --volume "$MODEL_FILE:/model/tiny.Q8_0.gguf:ro" \
    --volume "$HERE/plan.json:/etc/deploykit/plan.json:ro" \
    --publish 0.0.0.0:8000:8000 \
    "$IMAGE"
echo "deployment $DEPLOYMENT: port 8000 on 0.0.0.0 (GET /health)"
