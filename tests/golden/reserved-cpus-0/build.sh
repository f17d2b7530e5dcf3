#!/usr/bin/env bash
# Build the engine image deploykit-engine:0.1.0 for deployment "qwen" (rendered by deploykit 0.1.0).
#
#   ./build.sh                 stage ./wheels, docker build this directory, copy the image's SBOM to ./sbom.cdx.json
# Env: IMAGE (default deploykit-engine:0.1.0), DOCKER (default docker), PYTHON (default python3),
#      DEPLOYKIT_WHEEL  a built deploykit wheel to use as is, or
#      DEPLOYKIT_SRC    a deploykit source checkout to build one from (default: the checkout PYTHON imports
#                       deploykit from).
# Extra arguments go to `docker build` (e.g. --build-arg KERNELS=off).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
IMAGE="${IMAGE:-deploykit-engine:0.1.0}"
DOCKER="${DOCKER:-docker}"
PYTHON="${PYTHON:-python3}"

mkdir -p wheels
rm -f wheels/deploykit-*.whl
if [ -n "${DEPLOYKIT_WHEEL:-}" ]; then
    cp "$DEPLOYKIT_WHEEL" wheels/
else
    src="${DEPLOYKIT_SRC:-$("$PYTHON" -c 'import deploykit, pathlib; print(pathlib.Path(deploykit.__file__).resolve().parents[1])')}"
    if [ ! -f "$src/pyproject.toml" ]; then
        echo "build.sh: $src is not a deploykit source checkout; set DEPLOYKIT_SRC or DEPLOYKIT_WHEEL" >&2
        exit 2
    fi
    isolation=()
    "$PYTHON" -c 'import setuptools' 2>/dev/null && isolation=(--no-build-isolation)
    "$PYTHON" -m pip wheel --quiet --no-deps "${isolation[@]}" --wheel-dir wheels "$src"
fi
"$DOCKER" build -t "$IMAGE" "$@" .
# The bill of materials the build wrote into the image, next to the files it was built from.
id="$("$DOCKER" create "$IMAGE")"
trap '"$DOCKER" rm "$id" >/dev/null' EXIT
"$DOCKER" cp "$id:/opt/deploykit/sbom.cdx.json" sbom.cdx.json
echo "built $IMAGE; its SBOM is $(pwd)/sbom.cdx.json"
