# Sourced by scripts/demo and scripts/test: a project virtualenv with deploykit + engine installed.
# torch is pinned to 2.13.0 first: a range that admits newer releases would pull a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DEPLOYKIT_VENV:-$ROOT/.venv}"
EXTRAS="${DEPLOYKIT_EXTRAS:-engine}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.deploykit-installed-$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-12)-${EXTRAS//,/-}"
if [ ! -f "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e "$ROOT[$EXTRAS]"
  touch "$stamp"
fi
# Native kernels are compiled ahead of time, never on a request path; a no-op when already built.
python -m engine.kernels build >/dev/null 2>&1 || echo "note: native kernels not built; the engine uses its PyTorch fallback" >&2
cd "$ROOT"
