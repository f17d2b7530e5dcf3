#!/usr/bin/env bash
# Run deployment "qwen" with plain `docker run`: 4 engine replicas behind nginx.
# Rendered by deploykit 0.1.0 from plan.json; edit the spec and re-render rather than this file.
#
#   ./build.sh                           build the image first
#   MODEL_DIR=/path/to/model ./run.sh    start; re-running replaces this deployment's containers
#   ./run.sh down                        stop and remove them
# Env: MODEL_DIR (the model directory on this host, mounted read-only at /model), IMAGE (default
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
    "$DOCKER" network rm qwen >/dev/null 2>&1 || true
    exit 0
fi
MODEL_DIR="${MODEL_DIR:?set MODEL_DIR to the model directory on this host (nothing is downloaded at run time)}"

# Replicas and the load balancer find each other by container name on this network.
"$DOCKER" network inspect qwen >/dev/null 2>&1 \
    || "$DOCKER" network create --label "deploykit.deployment=$DEPLOYMENT" qwen >/dev/null

# replica 0 on NUMA node 0: inference CPUs 0-26,112-138 (54 OpenMP threads), front end on CPUs 27,139; memory on node 0, limit 98.0 GiB
replace qwen-0
"$DOCKER" run --detach \
    --name qwen-0 \
    --label deploykit.deployment=qwen \
    --label deploykit.replica=0 \
    --restart unless-stopped \
    --stop-timeout 50 \
    --network qwen \
    --cpuset-cpus 0-27,112-139 \
    --cpuset-mems 0 \
    --memory 105207453900 \
    --memory-swap 105207453900 \
    --shm-size 256m \
    --user 10001:10001 \
    --read-only \
    --tmpfs /tmp:rw,nosuid,nodev,size=1g \
    --cap-drop ALL \
    --security-opt no-new-privileges \
    --security-opt "seccomp=$HERE/seccomp.json" \
    --env DEPLOYKIT_CPUS=0-26,112-138 \
    --env DEPLOYKIT_FRONTEND_CPUS=27,139 \
    --env DEPLOYKIT_MEMS=0 \
    --env DEPLOYKIT_REPLICA=0 \
    --env OMP_NUM_THREADS=54 \
    --volume "$MODEL_DIR:/model:ro" \
    --volume "$HERE/plan.json:/etc/deploykit/plan.json:ro" \
    --publish 0.0.0.0:8001:8000 \
    "$IMAGE"

# replica 1 on NUMA node 1: inference CPUs 28-54,140-166 (54 OpenMP threads), front end on CPUs 55,167; memory on node 1, limit 98.0 GiB
replace qwen-1
"$DOCKER" run --detach \
    --name qwen-1 \
    --label deploykit.deployment=qwen \
    --label deploykit.replica=1 \
    --restart unless-stopped \
    --stop-timeout 50 \
    --network qwen \
    --cpuset-cpus 28-55,140-167 \
    --cpuset-mems 1 \
    --memory 105207453900 \
    --memory-swap 105207453900 \
    --shm-size 256m \
    --user 10001:10001 \
    --read-only \
    --tmpfs /tmp:rw,nosuid,nodev,size=1g \
    --cap-drop ALL \
    --security-opt no-new-privileges \
    --security-opt "seccomp=$HERE/seccomp.json" \
    --env DEPLOYKIT_CPUS=28-54,140-166 \
    --env DEPLOYKIT_FRONTEND_CPUS=55,167 \
    --env DEPLOYKIT_MEMS=1 \
    --env DEPLOYKIT_REPLICA=1 \
    --env OMP_NUM_THREADS=54 \
    --volume "$MODEL_DIR:/model:ro" \
    --volume "$HERE/plan.json:/etc/deploykit/plan.json:ro" \
    --publish 0.0.0.0:8002:8000 \
    "$IMAGE"

# replica 2 on NUMA node 2: inference CPUs 56-82,168-194 (54 OpenMP threads), front end on CPUs 83,195; memory on node 2, limit 98.0 GiB
replace qwen-2
"$DOCKER" run --detach \
    --name qwen-2 \
    --label deploykit.deployment=qwen \
    --label deploykit.replica=2 \
    --restart unless-stopped \
    --stop-timeout 50 \
    --network qwen \
    --cpuset-cpus 56-83,168-195 \
    --cpuset-mems 2 \
    --memory 105207453900 \
    --memory-swap 105207453900 \
    --shm-size 256m \
    --user 10001:10001 \
    --read-only \
    --tmpfs /tmp:rw,nosuid,nodev,size=1g \
    --cap-drop ALL \
    --security-opt no-new-privileges \
    --security-opt "seccomp=$HERE/seccomp.json" \
    --env DEPLOYKIT_CPUS=56-82,168-194 \
    --env DEPLOYKIT_FRONTEND_CPUS=83,195 \
    --env DEPLOYKIT_MEMS=2 \
    --env DEPLOYKIT_REPLICA=2 \
    --env OMP_NUM_THREADS=54 \
    --volume "$MODEL_DIR:/model:ro" \
    --volume "$HERE/plan.json:/etc/deploykit/plan.json:ro" \
    --publish 0.0.0.0:8003:8000 \
    "$IMAGE"

# replica 3 on NUMA node 3: inference CPUs 84-110,196-222 (54 OpenMP threads), front end on CPUs 111,223; memory on node 3, limit 98.0 GiB
replace qwen-3
"$DOCKER" run --detach \
    --name qwen-3 \
    --label deploykit.deployment=qwen \
    --label deploykit.replica=3 \
    --restart unless-stopped \
    --stop-timeout 50 \
    --network qwen \
    --cpuset-cpus 84-111,196-223 \
    --cpuset-mems 3 \
    --memory 105207453900 \
    --memory-swap 105207453900 \
    --shm-size 256m \
    --user 10001:10001 \
    --read-only \
    --tmpfs /tmp:rw,nosuid,nodev,size=1g \
    --cap-drop ALL \
    --security-opt no-new-privileges \
    --security-opt "seccomp=$HERE/seccomp.json" \
    --env DEPLOYKIT_CPUS=84-110,196-222 \
    --env DEPLOYKIT_FRONTEND_CPUS=111,223 \
    --env DEPLOYKIT_MEMS=3 \
    --env DEPLOYKIT_REPLICA=3 \
    --env OMP_NUM_THREADS=54 \
    --volume "$MODEL_DIR:/model:ro" \
    --volume "$HERE/plan.json:/etc/deploykit/plan.json:ro" \
    --publish 0.0.0.0:8004:8000 \
    "$IMAGE"

# nginx load balancer (least connections, streaming) in front of the replicas; runs from the engine image, so nothing is pulled from a registry
replace qwen-lb
"$DOCKER" run --detach \
    --name qwen-lb \
    --label deploykit.deployment=qwen \
    --label deploykit.replica=lb \
    --restart unless-stopped \
    --stop-timeout 50 \
    --stop-signal SIGQUIT \
    --network qwen \
    --cpuset-cpus 27,55,83,111,139,167,195,223 \
    --memory 268435456 \
    --memory-swap 268435456 \
    --user 10001:10001 \
    --read-only \
    --tmpfs /tmp:rw,nosuid,nodev,noexec,size=64m \
    --cap-drop ALL \
    --security-opt no-new-privileges \
    --security-opt "seccomp=$HERE/seccomp.json" \
    --volume "$HERE/nginx.conf:/etc/deploykit/nginx.conf:ro" \
    --publish 0.0.0.0:8000:8000 \
    --entrypoint /usr/sbin/nginx \
    "$IMAGE" -e stderr -c /etc/deploykit/nginx.conf
echo "deployment $DEPLOYMENT: 4 replicas behind port 8000 on 0.0.0.0 (GET /health)"
