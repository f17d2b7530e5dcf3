"""`deploykit doctor --container NAME`: a Docker container, any image. Through the Docker SDK: its configuration
(environment, seccomp profile, capabilities, cpuset, CPU quota) and its main process's host PID; then its
processes are sampled from the host's /proc like --pid, and the NUMA calls are probed inside it (`docker exec`
of deploykit.numa's probe) under the container's real seccomp profile and capabilities.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import replace

from .. import numa, procfs, topology
from ..errors import TargetError, did_you_mean
from ..hostsettings import CAP_SYS_NICE, HostSettings, Probe, relevant
from . import checks, fixes, openmp
from .findings import FAIL, INFO, OK, WARN, Finding, Report, Section
from .process_target import examine_pid

DOCKER_DEFAULT_CAPS = frozenset({"CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID",
                                 "SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE"})


def examine(name: str, seconds: float) -> Report:
    c = _container(name)
    attrs = c.attrs
    pid = attrs["State"].get("Pid") or 0
    if not pid or not os.path.isdir(f"/proc/{pid}"):
        raise TargetError("the container's processes are not visible from here (a remote Docker daemon, or another "
                          "PID namespace)", path="--container", value=name,
                          hint="run `deploykit doctor --pid 1` inside the container (docker exec), or doctor on the "
                               "Docker host")
    hc, cfg = attrs["HostConfig"], attrs["Config"]
    env = dict(item.split("=", 1) for item in cfg.get("Env") or () if "=" in item)
    env = {k: v for k, v in env.items() if relevant(k)}
    topo = topology.read("/", pid=pid)
    section = Section(f"Container {attrs['Name'].lstrip('/')} ({cfg.get('Image')})",
                      (_numa_calls(c, hc, pid, topo), *_config(hc, topo)))
    envs = openmp.env_findings(env, topo, openmp.Scope("the container's environment (docker run -e, image ENV)",
                                                       everything=True),
                               runtimes=_mapped_runtimes(pid), judge_thread_count=True)
    # Ids get a "container." prefix: the process checks judge the inference process's own environment as well.
    rep = examine_pid(pid, seconds, extra=(section, Section("Container environment", tuple(
        replace(f, id=f"container.{f.id}") for f in envs if f.id != "malloc.tcmalloc"))))
    return Report(f"container {attrs['Name'].lstrip('/')}: {rep.target}", rep.sections, rep.data)


def _container(name: str):
    try:
        import docker
        from docker.errors import DockerException, NotFound
    except ImportError:
        raise TargetError("--container needs the Docker SDK", hint="pip install 'deploykit[docker]'") from None
    try:
        client = docker.from_env()
        try:
            c = client.containers.get(name)
        except NotFound:
            names = [x.name for x in client.containers.list()]
            raise TargetError("no such container", path="--container", value=name,
                              allowed=", ".join(sorted(names)[:20]) or "no running containers",
                              hint=did_you_mean(name, names)) from None
    except DockerException as e:
        raise TargetError(f"cannot reach the Docker daemon: {e}", path="--container", value=name,
                          hint="is dockerd running, and may this user use /var/run/docker.sock?") from None
    if c.status != "running":
        raise TargetError(f"the container is {c.status}", path="--container", value=name,
                          hint="doctor examines running containers: docker start it first")
    return c


def _mapped_runtimes(pid: int) -> tuple[str, ...] | None:
    from ..process import tree
    found: set[str] = set()
    for p in tree(pid):
        try:
            found |= set(procfs.omp_runtimes(procfs.read_mapped_files(p)))
        except OSError:
            continue
    return tuple(sorted(found)) or None


def _caps(hc: dict) -> frozenset[str]:
    norm = lambda caps: {c.upper().removeprefix("CAP_") for c in caps or ()}  # noqa: E731
    add, drop = norm(hc.get("CapAdd")), norm(hc.get("CapDrop"))
    if hc.get("Privileged") or "ALL" in add:
        return frozenset({"ALL"})
    return frozenset((set() if "ALL" in drop else DOCKER_DEFAULT_CAPS - drop) | add)


PROBE_CALL = "\nimport json, sys\nprint(json.dumps(probe(int(sys.argv[1]))))\n"


def _probe_inside(c, node: int) -> Probe | None:
    """deploykit.numa's probe (stdlib only), run by the container's python3 under its own seccomp and caps."""
    source = inspect.getsource(numa) + PROBE_CALL
    for python in ("python3", "python"):
        try:
            res = c.exec_run([python, "-c", source, str(node)], demux=True)
        except Exception:  # the SDK raises APIError subclasses for exec failures; any failure means "cannot probe"
            return None
        out = (res.output[0] or b"") if isinstance(res.output, tuple) else res.output
        if res.exit_code == 0:
            try:
                calls = json.loads(out.decode().strip().splitlines()[-1])
            except (ValueError, IndexError):
                return None
            return Probe(tuple(sorted((k, int(v)) for k, v in calls.items())), None)
    return None


def _numa_calls(c, hc: dict, pid: int, topo) -> Finding:
    opts = [o for o in hc.get("SecurityOpt") or () if o.startswith("seccomp")]
    profile = opts[0].split("=", 1)[1] if opts and "=" in opts[0] else ("unconfined" if opts else "default")
    if hc.get("Privileged"):
        profile = "unconfined"
    caps = _caps(hc)
    nice = "ALL" in caps or "SYS_NICE" in caps
    try:
        status = procfs.read_status(pid)
    except OSError:
        status = {}
    probe = _probe_inside(c, topo.allowed_mems[0] if topo.allowed_mems else 0)
    described = ("Docker's default seccomp profile" if profile == "default" else "no seccomp filter"
                 if profile == "unconfined" else "a custom seccomp profile") + \
        f"; capabilities: {'all' if 'ALL' in caps else ', '.join(sorted(caps)) or 'none'}"
    settings = HostSettings(numa_balancing=None, thp_enabled=None, thp_defrag=None,
                            seccomp_mode=procfs.int_field(status.get("Seccomp")), no_new_privs=None,
                            cap_eff=(1 << CAP_SYS_NICE) if nice else 0, env=(), ld_so_preload=(), probe=probe,
                            live=True)
    if probe is not None:
        return checks.numa_calls(topo, settings, probed_on="the memory of a process docker exec started in the "
                                 "container", context=(described,))
    # No python in the image: judge from the configuration (Docker's default profile is known).
    if profile == "default":
        refused = fixes.NUMA_CALLS if not nice else ("migrate_pages", "move_pages")
        return Finding("numa.syscalls", FAIL if not nice else WARN,
                       f"NUMA calls refused by Docker's default seccomp profile: {', '.join(refused)} (from the "
                       "container's configuration; no python3 in the image to probe)", evidence=(described,),
                       fix=fixes.numa_calls(refused))
    return Finding("numa.syscalls", INFO, f"NUMA calls not probed (no python3 in the image): {described}")


def _config(hc: dict, topo) -> list[Finding]:
    out = []
    cpuset = hc.get("CpusetCpus") or ""
    nano = hc.get("NanoCpus") or 0
    quota = (hc.get("CpuQuota") or 0) / (hc.get("CpuPeriod") or 100000) if hc.get("CpuQuota") else None
    limit = nano / 1e9 if nano else quota
    ncpus = len(topo.cpuset or topo.allowed_cpus)
    if limit is not None and limit < ncpus:
        out.append(Finding("container.cpus", WARN, f"the container has a CPU quota of {limit:g} CPUs over a "
                           f"{ncpus}-CPU cpuset ({cpuset or 'all CPUs'})",
                           evidence=(f"HostConfig: NanoCpus={nano}, CpuQuota={hc.get('CpuQuota')}, "
                                     f"CpusetCpus={cpuset!r}",),
                           fix=("docker run --cpuset-cpus=<CPUs> instead of --cpus: exclusive CPUs, no throttling",)))
    else:
        out.append(Finding("container.cpus", OK, f"cpuset {cpuset or 'all CPUs'}"
                           + (f", quota {limit:g} CPUs" if limit else ", no CPU quota")))
    if not hc.get("CpusetMems") and len([n for n in topo.nodes if n.memory_bytes]) > 1:
        out.append(Finding("container.mems", INFO, "no --cpuset-mems: memory placement is up to the process's own "
                           "binding"))
    return out
