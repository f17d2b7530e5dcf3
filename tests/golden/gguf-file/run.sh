#!/usr/bin/env bash
# Run deployment "qwen" with plain `docker run`: 1 engine replica behind nginx.
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
    "$DOCKER" network rm qwen-edge >/dev/null 2>&1 || true
    "$DOCKER" network rm qwen-internal >/dev/null 2>&1 || true
    exit 0
fi
MODEL_FILE="${MODEL_FILE:-/spec/tiny.Q8_0.gguf}"

# Members find each other by container name. The engines' network is internal, with no address on this host: no
# route out, not even to this host's own services. Only the load balancer joins the edge network and publishes.
"$DOCKER" network inspect qwen-edge >/dev/null 2>&1 \
    || "$DOCKER" network create --label "deploykit.deployment=$DEPLOYMENT" qwen-edge >/dev/null
"$DOCKER" network inspect qwen-internal >/dev/null 2>&1 \
    || "$DOCKER" network create --label "deploykit.deployment=$DEPLOYMENT" --internal --opt com.docker.network.bridge.inhibit_ipv4=true qwen-internal >/dev/null

# replica 0 on NUMA node 0: inference CPUs 0-1 (2 OpenMP threads), front end shares those CPUs; memory on node 0, limit 2.0 GiB
replace qwen-0
"$DOCKER" run --detach \
    --name qwen-0 \
    --label deploykit.deployment=qwen \
    --label deploykit.replica=0 \
    --restart unless-stopped \
    --stop-timeout 50 \
    --network qwen-internal \
    --cpuset-cpus 0-1 \
    --cpuset-mems 0 \
    --memory 2152465856 \
    --memory-swap 2152465856 \
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
    "$IMAGE"

# nginx load balancer (least connections, streaming) in front of the replica, the only published port; runs from the engine image, so nothing is pulled from a registry
replace qwen-lb
"$DOCKER" create \
    --name qwen-lb \
    --label deploykit.deployment=qwen \
    --label deploykit.replica=lb \
    --restart unless-stopped \
    --stop-timeout 50 \
    --stop-signal SIGQUIT \
    --network qwen-edge \
    --memory 268435456 \
    --memory-swap 268435456 \
    --user 10001:10001 \
    --read-only \
    --tmpfs /tmp:rw,nosuid,nodev,noexec,size=64m \
    --cap-drop ALL \
    --security-opt no-new-privileges \
    --sysctl net.ipv4.tcp_keepalive_intvl=2 \
    --sysctl net.ipv4.tcp_keepalive_probes=3 \
    --sysctl net.ipv4.tcp_keepalive_time=2 \
    --sysctl net.ipv4.tcp_retries2=4 \
    --security-opt "seccomp=$HERE/seccomp.json" \
    --volume "$HERE/nginx.conf:/etc/deploykit/nginx.conf:ro" \
    --publish 0.0.0.0:8000:8000 \
    --entrypoint /usr/sbin/nginx \
    "$IMAGE" -e stderr -c /etc/deploykit/nginx.conf
"$DOCKER" network connect --alias qwen-lb qwen-internal qwen-lb
"$DOCKER" start qwen-lb >/dev/null
echo "deployment $DEPLOYMENT: 1 replica behind port 8000 on 0.0.0.0 (GET /health)"
