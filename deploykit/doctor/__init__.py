"""`deploykit doctor`: why inference uses 2 threads instead of 192, measured instead of guessed.

Three things can be examined: this host or container (checks.py over a Topology and HostSettings, or a
`--sysroot` snapshot; plus a spec's plan against it, planfit.py), any running process (deploykit.process reads /proc,
threads.py judges it; sources: --pid, --url for our own server, --container through the Docker API), and the
findings are printed by report.py as ✔ / ⚠ / ✖ lines, each problem with its evidence and its fix.
"""
