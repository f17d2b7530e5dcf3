#!/bin/sh
# Build the offline base image deploykit-base:bookworm from a debootstrap rootfs (no registry needed).
#
# Usage: images/base/build-base.sh [--force]
# Env:   DEPLOYKIT_BASE_IMAGE (default deploykit-base:bookworm), DEBIAN_MIRROR (default deb.debian.org).
# Skips the build when the image already exists. Callers wrap it in the heavy-job flock; this script only
# takes its own build lock so two concurrent callers never debootstrap twice.
set -eu

IMAGE="${DEPLOYKIT_BASE_IMAGE:-deploykit-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
# python3 runs the engine and probes; libgomp/tcmalloc/libnuma back torch; numactl for manual binding;
# nginx fronts one-server-per-NUMA-node layouts.
PACKAGES=python3,python3-venv,libgomp1,libtcmalloc-minimal4,libnuma1,numactl,nginx,ca-certificates

force=0
[ "${1:-}" = "--force" ] && force=1

exec 9>/tmp/deploykit-base-image.lock
flock 9

if [ "$force" = 0 ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "$IMAGE already present; skipping build" >&2
    exit 0
fi

for tool in debootstrap docker tar; do
    command -v "$tool" >/dev/null 2>&1 || { echo "build-base.sh: $tool not found" >&2; exit 2; }
done

ROOT="$(mktemp -d /tmp/deploykit-rootfs.XXXXXX)"
trap 'rm -rf "$ROOT"' EXIT INT TERM

start=$(date +%s)
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT" "$MIRROR" >&2

# Shrink the layer: package caches and lists are useless in an offline image.
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/log/*.log \
       "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/*
# Unprivileged runtime user (UID >= 10000, as kube-score wants); containers still pass --user explicitly.
echo "deploykit:x:10001:10001:deploykit:/nonexistent:/usr/sbin/nologin" >>"$ROOT/etc/passwd"
echo "deploykit:x:10001:" >>"$ROOT/etc/group"

tar -C "$ROOT" --numeric-owner -c . | docker import \
    --change 'ENV LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1' \
    --change 'CMD ["python3"]' \
    - "$IMAGE" >&2
echo "built $IMAGE in $(( $(date +%s) - start ))s" >&2
