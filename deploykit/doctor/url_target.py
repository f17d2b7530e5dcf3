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

from .. import cpulist
from ..errors import TargetError
from ..process import Proc, Sample, Thread
from ..topology import CacheGroup, Cpu, Node, Topology
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
    a, b = before["engine"], after["engine"]
    sample = Sample({a["pid"]: _proc(a)}, {b["pid"]: _proc(b)}, elapsed)
    topo = _topology(b["topology"])
    omp = frozenset(t["tid"] for t in b["threads"] if t["omp_thread"] is not None)
    ctx = Context(topo, None, omp, f"{done['requests']} generation(s), {done['tokens']} tokens")
    sections = [Section("Binding", _binding(b, after.get("frontend") or {}))] + analyse(sample, ctx)
    return Report(f"deploykit server {url} (engine pid {b['pid']} as it sees itself)", tuple(sections),
                  data={"binding_before": before, "binding_after": after, "seconds": round(elapsed, 3)})


def _binding(rep: dict, frontend: dict) -> tuple[Finding, ...]:
    """What the engine says about its own binding: the plan it was given and what applying it found."""
    out = []
    if rep.get("warnings"):
        out += [Finding("binding.warning", FAIL if "refused" in w else WARN, w) for w in rep["warnings"]]
    planned = rep.get("planned_cpus")
    if planned:
        out.append(Finding("binding.cpus", OK, f"{rep.get('omp_threads')} OpenMP threads planned on CPUs {planned}; "
                           f"front end on {frontend.get('allowed_cpus') or rep.get('frontend_cpus') or 'the same CPUs'}"))
    else:
        out.append(Finding("binding.cpus", WARN, "the engine runs unpinned (--binding none)",
                           fix=("start it with --binding auto or from a plan",)))
    pol = rep.get("memory_policy") or {}
    if "error" in pol:
        out.append(Finding("binding.memory", FAIL, f"get_mempolicy failed in the engine: {pol['error']}"))
    elif rep.get("planned_mems") and pol.get("mode") in ("bind", "interleave"):
        out.append(Finding("binding.memory", OK, f"memory {pol['mode']} on node(s) {pol.get('nodes')}, as planned "
                           f"({rep['planned_mems']})"))
    elif rep.get("planned_mems"):
        out.append(Finding("binding.memory", WARN, f"memory policy {pol.get('mode')} although node(s) "
                           f"{rep['planned_mems']} were planned"))
    return tuple(out)


def _proc(rep: dict) -> Proc:
    threads = tuple(Thread(t["tid"], t["name"], cpulist.parse(t["allowed_cpus"]), t["last_cpu"],
                           int(t["cpu_seconds"] * 1e9), int(t.get("wait_seconds", 0) * 1e9)) for t in rep["threads"])
    pages = {policy: {int(n): v for n, v in nodes.items()} for policy, nodes in (rep.get("numa_pages") or {}).items()}
    return Proc(pid=rep["pid"], ppid=0, name="engine", cmdline="deploykit engine", uid=-1, threads=threads,
                libraries=tuple(rep.get("libraries") or rep.get("openmp_runtimes") or ()),
                env=rep.get("environment"), numa_pages=pages if rep.get("numa_pages") is not None else None,
                seccomp=rep.get("seccomp"), cap_eff=None, mems_allowed=cpulist.parse(rep.get("mems_allowed") or "0"),
                unreadable=())


def _topology(t: dict) -> Topology:
    # [id, socket, node, core, l3]; servers before L3 groups send four fields
    cpus = tuple(Cpu(c[0], c[1], c[2], tuple(c[3]), c[4] if len(c) > 4 else None) for c in t["cpus"])
    groups = tuple(CacheGroup(i, cpulist.parse(c), size) for i, c, size in t.get("l3_groups") or ())
    nodes = tuple(Node(i, cpulist.parse(c), mem) for i, c, mem in t["nodes"])
    # The engine's main thread is OpenMP worker 0, pinned to one CPU: what the process may use is its cpuset.
    may = cpulist.parse(t["cpuset"]) if t["cpuset"] else tuple(c.id for c in cpus)
    return Topology(cpus=cpus, offline=(), nodes=nodes, allowed_cpus=may,
                    allowed_mems=cpulist.parse(t["allowed_mems"]), quota_cpus=t["quota_cpus"], memory_limit_bytes=None,
                    isa=tuple(t["isa"]), cpu_model=t["cpu_model"], source="server",
                    cpuset=None if t["cpuset"] is None else cpulist.parse(t["cpuset"]), l3_groups=groups)


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
