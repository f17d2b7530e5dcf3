"""`deploykit doctor --url URL`: a running deploykit server, judged from its own binding report (GET /debug/binding)
read before and after a short generation doctor drives through the OpenAI API. The report comes from inside the
engine process, so this works for a server in a container or on another machine, where /proc here shows nothing.

HTTP through urllib: doctor stays within deploykit's own dependencies (no HTTP client library needed for three
small requests).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace

from .. import cpulist
from ..binding_report import BindingReport, EngineReport, FrontendReport
from ..errors import TargetError
from ..process import Proc, Sample, Thread
from .findings import FAIL, OK, WARN, Finding, Report, Section
from .threads import Context, analyse

MAX_TOKENS = 32


def examine(url: str, seconds: float, api_key: str | None) -> Report:
    base = url.rstrip("/")
    before = _get(base, "/debug/binding", api_key)
    model = _get(base, "/v1/models", api_key)["data"][0]["id"]
    done = {"requests": 0, "tokens": 0, "error": ""}

    def generate() -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or not done["requests"]:
            try:
                out = _post(base, "/v1/completions", api_key, {
                    "model": model, "prompt": "The quick brown fox", "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True})
            except TargetError as e:
                done["error"] = str(e)
                return
            done["requests"] += 1
            done["tokens"] += out.get("usage", {}).get("completion_tokens", 0)

    t0 = time.monotonic()
    worker = threading.Thread(target=generate, daemon=True)
    worker.start()
    worker.join()
    elapsed = time.monotonic() - t0
    after = _get(base, "/debug/binding", api_key)
    if done["error"]:
        raise TargetError(f"the generation doctor drives failed: {done['error']}", path="--url", value=url)
    a, b = BindingReport.from_dict(before).engine, BindingReport.from_dict(after)
    sample = Sample({a.pid: _proc(a)}, {b.engine.pid: _proc(b.engine)}, elapsed)
    # The engine's main thread is OpenMP worker 0, pinned to one CPU: what the process may use is its cpuset.
    seen = b.engine.topology
    topo = replace(seen, allowed_cpus=seen.cpuset or tuple(c.id for c in seen.cpus), memory_limit_bytes=None,
                   source="server")
    omp = frozenset(t.tid for t in b.engine.omp)
    ctx = Context(topo, None, omp, f"{done['requests']} generation(s), {done['tokens']} tokens")
    sections = [Section("Binding", _binding(b.engine, b.frontend))] + analyse(sample, ctx)
    return Report(f"deploykit server {url} (engine pid {b.engine.pid} as it sees itself)", tuple(sections),
                  data={"binding_before": before, "binding_after": after, "seconds": round(elapsed, 3)})


def _binding(rep: EngineReport, frontend: FrontendReport) -> tuple[Finding, ...]:
    """What the engine says about its own binding: the plan it was given and what applying it found."""
    out = [Finding("binding.warning", FAIL if "refused" in w else WARN, w) for w in rep.warnings]
    if rep.planned_cpus:
        front = cpulist.format(frontend.allowed_cpus or rep.frontend_cpus or ()) or "the same CPUs"
        out.append(Finding("binding.cpus", OK, f"{rep.omp_threads} OpenMP threads planned on CPUs "
                           f"{cpulist.format(rep.planned_cpus)}; front end on {front}"))
    else:
        out.append(Finding("binding.cpus", WARN, "the engine runs unpinned (--binding none)",
                           fix=("start it with --binding auto or from a plan",)))
    pol, planned = rep.memory_policy, cpulist.format(rep.planned_mems or ())
    if pol.error is not None:
        out.append(Finding("binding.memory", FAIL, f"get_mempolicy failed in the engine: {pol.error}"))
    elif planned and pol.bound:
        out.append(Finding("binding.memory", OK, f"memory {pol.mode} on node(s) {cpulist.format(pol.nodes)}, as "
                           f"planned ({planned})"))
    elif planned:
        out.append(Finding("binding.memory", WARN, f"memory policy {pol.mode} although node(s) {planned} were "
                           "planned"))
    return tuple(out)


def _proc(rep: EngineReport) -> Proc:
    threads = tuple(Thread(t.tid, t.name, t.allowed_cpus, t.last_cpu, int(t.cpu_seconds * 1e9),
                           int(t.wait_seconds * 1e9)) for t in rep.threads)
    return Proc(pid=rep.pid, ppid=0, name="engine", cmdline="deploykit engine", uid=-1, threads=threads,
                libraries=rep.libraries, env=rep.environment, numa_pages=rep.numa_pages, seccomp=rep.seccomp,
                cap_eff=None, mems_allowed=rep.mems_allowed, unreadable=())


def _request(req: urllib.request.Request, url: str, timeout: float = 120) -> dict:
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise TargetError("the server wants an API key", path="--url", value=url,
                              hint="pass --api-key or set DEPLOYKIT_API_KEY") from None
        if e.code == 404 and req.full_url.endswith("/debug/binding"):
            raise TargetError("not a deploykit server (no /debug/binding)", path="--url", value=url,
                              hint="for vLLM, llama.cpp or Ollama use --pid PID or --container NAME") from None
        raise TargetError(f"HTTP {e.code} from {req.full_url}: {e.read()[:300]!r}", path="--url", value=url) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise TargetError(f"cannot reach the server: {getattr(e, 'reason', e)}", path="--url", value=url,
                          hint="check the address and port (e.g. http://127.0.0.1:8000)") from None


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _get(base: str, path: str, api_key: str | None) -> dict:
    return _request(urllib.request.Request(base + path, headers=_headers(api_key)), base, timeout=30)


def _post(base: str, path: str, api_key: str | None, body: dict) -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={**_headers(api_key), "Content-Type": "application/json"})
    return _request(req, base)
