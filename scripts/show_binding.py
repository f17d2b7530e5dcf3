"""Pretty-print GET /debug/binding (read from stdin): every engine thread, where it may run and where it ran."""
import json
import sys

report = json.load(sys.stdin)["engine"]
print(f"  {report['omp_threads']} OpenMP threads on CPUs {report['planned_cpus'] or 'unpinned'}; "
      f"memory policy {report['memory_policy']}; OpenMP runtimes loaded: {len(report['openmp_runtimes'])}")
for t in report["threads"]:
    role = f"omp {t['omp_thread']}" if t["omp_thread"] is not None else "other"
    print(f"  tid {t['tid']:>7} {role:>6}  allowed CPUs {t['allowed_cpus']:>5}  last ran on {t['last_cpu']}  "
          f"cpu time {t['cpu_seconds']} s")
if weights := report.get("weights"):  # how the model's weights are held: quantized blocks or the model's dtype
    kinds = "; ".join(f"{t}: " + ", ".join(f"{n} {how}" for how, n in paths.items())
                      for t, paths in weights["by_type"].items())
    print(f"  weights held: {weights['bytes'] / 2**20:.1f} MiB ({kinds})")
for w in report["warnings"]:
    print("  warning:", w)
