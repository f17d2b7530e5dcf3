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
for w in report["warnings"]:
    print("  warning:", w)
