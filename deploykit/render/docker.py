"""The Docker target: what each container of a deployment is (shared with compose), the engine image build
context (Dockerfile, entrypoint, build.sh, plan.json, seccomp profiles) and run.sh (one `docker run` each).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from .. import __version__, cpulist
from ..plan import Plan, Replica
from ..units import human
from . import dq, nginx, seccomp, template
from .output import File

MODEL_DIR = "/model"
PLAN_PATH = "/etc/deploykit/plan.json"
NGINX_CONF = "/etc/deploykit/nginx.conf"
# The server's processes talk over a socketpair, not shared memory; /dev/shm only holds Python multiprocessing
# semaphores and small library buffers. Explicit, so a read-only root keeps a bounded writable shm.
SHM_SIZE = "256m"
# The only writable place under a read-only root: HOME, caches, nginx temp files. Not noexec: the engine may
# dlopen JIT-built kernels from its cache there.
TMPFS = "/tmp:rw,nosuid,nodev,size=1g"
LB_TMPFS = "/tmp:rw,nosuid,nodev,noexec,size=64m"
LB_MEMORY = 256 * 1024**2
RUNTIME_PACKAGES = ("libtcmalloc-minimal4", "libnuma1", "numactl")
# SIGTERM to SIGKILL: the engine drains in-flight requests for up to 30 s (`--shutdown-timeout`), uvicorn adds 5 s
# and the engine process gets 10 s to exit. Docker's default of 10 s would kill streams mid-answer.
ENGINE_STOP_SECONDS = 50


@dataclass(frozen=True, slots=True)
class Mount:
    source: str  # "model" (the user's model directory) or a file name in the output directory
    target: str


@dataclass(frozen=True, slots=True)
class Container:
    """One container, in runtime-neutral terms; run.sh and compose.yaml each spell it in their own syntax."""

    name: str
    deployment: str
    comment: str
    replica: int | None  # None for the load balancer
    cpuset: str | None
    mems: str | None  # cpuset-mems: docker run only; compose has none (the engine binds memory itself)
    memory: int
    env: tuple[tuple[str, str | None], ...]  # value None: passed through by name from the caller's environment
    mounts: tuple[Mount, ...]
    publish: str
    caps_add: tuple[str, ...]
    seccomp: str | None  # a profile file name, "unconfined", or None for the runtime's default
    user: str
    read_only: bool
    tmpfs: str
    shm_size: str | None
    entrypoint: tuple[str, ...] = ()  # () = the image's own
    depends_on: tuple[str, ...] = ()
    stop_seconds: int | None = None  # None = the runtime's default (10 s)
    stop_signal: str | None = None  # None = SIGTERM

    @property
    def labels(self) -> tuple[tuple[str, str], ...]:
        replica = "lb" if self.replica is None else str(self.replica)
        return (("deploykit.deployment", self.deployment), ("deploykit.replica", replica))


def seccomp_file(plan: Plan) -> str | None:
    mode = plan.security.seccomp
    return "seccomp.json" if mode == "least-privilege" else "unconfined" if mode == "unconfined" else None


def lb_name(plan: Plan) -> str:
    return f"{plan.name}-lb"


def healthcheck(port: int) -> tuple[str, ...]:
    """Exec form, no shell: python is in every image we build; curl is not."""
    code = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=4)"
    return ("python", "-c", code)


def containers(plan: Plan) -> tuple[Container, ...]:
    user = f"{plan.security.run_as_user}:{plan.security.run_as_user}"
    sec = seccomp_file(plan)
    port = plan.serving.port
    out = []
    for r in plan.replicas:
        env = [*r.env, ("DEPLOYKIT_REPLICA", str(r.index))]
        if plan.serving.api_key_env:
            env.append((plan.serving.api_key_env, None))
        out.append(Container(
            name=r.name, deployment=plan.name, comment=_describe(r), replica=r.index, cpuset=cpulist.format(r.cpuset),
            mems=cpulist.format(r.mems), memory=r.memory_limit_bytes, env=tuple(sorted(env)),
            mounts=(Mount("model", MODEL_DIR), Mount("plan.json", PLAN_PATH)),
            publish=f"{plan.serving.publish_address}:{r.port}:{port}", caps_add=("SYS_NICE",), seccomp=sec,
            user=user, read_only=plan.security.read_only_root, tmpfs=TMPFS, shm_size=SHM_SIZE,
            stop_seconds=ENGINE_STOP_SECONDS))
    if plan.serving.load_balancer:
        front = sorted({c for r in plan.replicas for c in r.frontend_cpus})
        out.append(Container(
            name=lb_name(plan), deployment=plan.name, replica=None,
            comment="nginx load balancer (least connections, streaming) in front of the replicas; runs from the "
                    "engine image, so nothing is pulled from a registry",
            cpuset=cpulist.format(front) if front else None, mems=None, memory=LB_MEMORY, env=(),
            mounts=(Mount("nginx.conf", NGINX_CONF),), publish=f"{plan.serving.publish_address}:{port}:{port}",
            caps_add=(), seccomp=sec, user=user, read_only=True, tmpfs=LB_TMPFS, shm_size=None,
            entrypoint=("/usr/sbin/nginx", "-e", "stderr", "-c", NGINX_CONF),
            depends_on=tuple(r.name for r in plan.replicas),
            # SIGQUIT is nginx's graceful stop: open streams run to the end while the replicas drain.
            stop_seconds=ENGINE_STOP_SECONDS, stop_signal="SIGQUIT"))
    return tuple(out)


def _describe(r: Replica) -> str:
    nodes = f"NUMA node{'s' if len(r.numa_nodes) > 1 else ''} {cpulist.format(r.numa_nodes)}"
    front = (f"front end on CPUs {cpulist.format(r.frontend_cpus)}" if r.frontend_cpus
             else "front end shares those CPUs")
    threads = f"{r.omp_threads} OpenMP thread{'s' if r.omp_threads > 1 else ''}"
    mems = f"node{'s' if len(r.mems) > 1 else ''} {cpulist.format(r.mems)}"
    return (f"replica {r.index} on {nodes}: inference CPUs {cpulist.format(r.cpus)} ({threads}), {front}; "
            f"memory on {mems}, limit {human(r.memory_limit_bytes)}")


def image_files(plan: Plan) -> list[File]:
    """The build context every container target shares, plus the files the containers mount."""
    offline = plan.image.wheelhouse is not None
    uid = plan.security.run_as_user
    packages = RUNTIME_PACKAGES + (("nginx",) if plan.serving.load_balancer else ())
    labels = (("org.opencontainers.image.title", plan.image.name),
              ("org.opencontainers.image.description", f"deploykit CPU inference engine for deployment {plan.name}"),
              ("org.opencontainers.image.version", plan.image.tag),
              ("org.opencontainers.image.licenses", "Apache-2.0"),
              ("org.opencontainers.image.base.name", plan.image.base),
              ("io.deploykit.version", __version__))
    ctx = dict(plan=plan, offline=offline, uid=uid, packages=packages, labels=labels,
               requirement=f"deploykit[engine]=={__version__}",
               healthcheck=list(healthcheck(plan.serving.port)))
    files = [
        File("Dockerfile", template("Dockerfile.j2", **ctx).encode()),
        File(".dockerignore", template("dockerignore.j2").encode()),
        File("entrypoint.sh", template("entrypoint.sh.j2", plan=plan, model_dir=MODEL_DIR,
                                       plan_path=PLAN_PATH).encode(), 0o755),
        File("build.sh", template("build.sh.j2", plan=plan, offline=offline).encode(), 0o755),
        File("plan.json", plan.to_json().encode()),
    ]
    profile = seccomp.profile(plan.security.seccomp)
    if profile is not None:
        files.append(File("seccomp.json", seccomp.dumps(profile)))
        # x86-64: the plan's ISA vocabulary (avx512*, amx*) only describes x86 hosts.
        files.append(File("seccomp-oci.json", seccomp.dumps(seccomp.flatten_for_oci(profile, arch="x86_64"))))
    if plan.serving.load_balancer:
        files.append(nginx.file(plan))
    return files


def files(plan: Plan) -> list[File]:
    return [*image_files(plan), File("run.sh", run_sh(plan).encode(), 0o755)]


def run_sh(plan: Plan) -> str:
    network = plan.name if plan.serving.load_balancer else None
    model = plan.model.path
    model_env = ("${MODEL_DIR:-" + dq(model) + "}" if model else
                 "${MODEL_DIR:?set MODEL_DIR to the model directory on this host (nothing is downloaded at run time)}")
    cs = [_RunArgs(c, network) for c in containers(plan)]
    return template("run.sh.j2", plan=plan, lb=plan.serving.load_balancer, network=network, containers=cs,
                    model_dir=MODEL_DIR, model_env=model_env, notes=_notes(plan))


def _notes(plan: Plan) -> list[str]:
    if plan.security.seccomp == "unconfined":
        return ["WARNING: security.seccomp is 'unconfined': these containers run without any syscall filter.",
                "The least-privilege profile (security.seccomp: least-privilege) allows NUMA binding and page",
                "migration and still blocks mount, ptrace, bpf, kexec and namespace creation."]
    if plan.security.seccomp == "runtime-default":
        return ["security.seccomp is 'runtime-default': Docker's profile blocks migrate_pages/move_pages, so the",
                "engine cannot move pages touched before it bound its memory (binding itself still works)."]
    return []


@dataclass(frozen=True, slots=True)
class _RunArgs:
    """A Container as `docker run` arguments, one shell-quoted flag (with its value) per line."""

    container: Container
    network: str | None

    @property
    def name(self) -> str:
        return self.container.name

    @property
    def comment(self) -> str:
        return self.container.comment

    @property
    def args(self) -> list[str]:
        c, q = self.container, shlex.quote
        a = [f"--name {q(c.name)}", *(f"--label {q(f'{k}={v}')}" for k, v in c.labels), "--restart unless-stopped"]
        if c.stop_seconds is not None:
            a.append(f"--stop-timeout {c.stop_seconds}")
        if c.stop_signal is not None:
            a.append(f"--stop-signal {c.stop_signal}")
        if self.network:
            a.append(f"--network {q(self.network)}")
        if c.cpuset:
            a.append(f"--cpuset-cpus {q(c.cpuset)}")
        if c.mems:
            a.append(f"--cpuset-mems {q(c.mems)}")
        a += [f"--memory {c.memory}", f"--memory-swap {c.memory}"]  # equal: no swapping behind the engine's back
        if c.shm_size:
            a.append(f"--shm-size {c.shm_size}")
        a.append(f"--user {c.user}")
        if c.read_only:
            a.append("--read-only")
        a += [f"--tmpfs {q(c.tmpfs)}", "--cap-drop ALL", *(f"--cap-add {cap}" for cap in c.caps_add),
              "--security-opt no-new-privileges"]
        if c.seccomp == "unconfined":
            a.append("--security-opt seccomp=unconfined")
        elif c.seccomp:
            a.append(f'--security-opt "seccomp=$HERE/{c.seccomp}"')
        for k, v in c.env:
            a.append(f"--env {k}" if v is None else f"--env {q(f'{k}={v}')}")
        for m in c.mounts:
            src = "$MODEL_DIR" if m.source == "model" else f"$HERE/{m.source}"
            a.append(f'--volume "{src}:{m.target}:ro"')
        a.append(f"--publish {q(c.publish)}")
        if c.entrypoint:
            a.append(f"--entrypoint {q(c.entrypoint[0])}")
        a.append(" ".join(['"$IMAGE"', *(q(x) for x in c.entrypoint[1:])]))
        return a

