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
  # An editable install of a project with a package-dir mapping (images/ -> deploykit.images) makes setuptools print
  # a page-long "Editable installation." notice (its InformationOnly class: information, not a problem).
  PYTHONWARNINGS="ignore:Editable installation" python -m pip install -q -e "$ROOT[$EXTRAS]"
  touch "$stamp"
fi
# Native kernels are compiled ahead of time, never on a request path; a no-op when already built. A failed build
# is shown, not hidden: on a CPU that runs them (AVX-512, or AVX2 for quantized weights) the engine would silently
# lose its fast path, so with DEPLOYKIT_REQUIRE_KERNELS=1 (scripts/test) it stops here.
if ! kernel_log=$(python -m engine.kernels build 2>&1); then
  if python -c 'import sys; from deploykit import isa; from engine.kernels import loader; sys.exit(loader.variant_for(isa.cpu_flags()) is None)'; then
    echo "$kernel_log" | tail -40 >&2
    echo "error: the native kernels failed to build on this CPU, which runs them (output above)" >&2
    if [ "${DEPLOYKIT_REQUIRE_KERNELS:-0}" = 1 ]; then return 1 2>/dev/null || exit 1; fi
    echo "note: continuing with the PyTorch fallback (several times slower in bf16)" >&2
  else
    echo "note: this CPU has no AVX2; the engine uses its PyTorch path" >&2
  fi
fi
cd "$ROOT"
