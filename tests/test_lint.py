"""Names that do not exist fail at run time, often on an error path no other test walks (a 500 instead of a 400):
pyflakes finds them statically in every module of deploykit/ and engine/."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_undefined_names():
    r = subprocess.run([sys.executable, "-m", "pyflakes", "deploykit", "engine", "tests", "benchmarks", "scripts"],
                       capture_output=True, text=True, cwd=ROOT)
    bad = [line for line in r.stdout.splitlines() if "undefined name" in line or "redefinition of unused" in line]
    assert not bad, "\n".join(bad)
