"""What each container of a deployment is, in runtime-neutral terms: run.sh, compose.yaml and `deploykit up` each
spell the same `Container` in their own syntax, so a setting cannot differ between them.

Networks: the engines sit on an internal network (no route out of it: a compromised or prompt-injected engine
reaches nothing but its peers), and only the load balancer, on that network and on an edge network, publishes a
port. So a single replica gets a load balancer too: an engine that published its own port would need a routed
network.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import cpulist
from ..plan import Plan, Replica
from ..units import human

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
# Networks by role; each syntax names them (run.sh and `up`: "<deployment>-<role>", compose: the role).
INTERNAL, EDGE = "internal", "edge"
# A load balancer notices a replica that vanished (a killed container, a lost node) within ~8 s instead of waiting on
# it for the read timeout: keep-alive probes on idle upstream connections after 2 s, every 2 s, 3 unanswered = dead;
# unacknowledged data (a request sent on a pooled connection to it) gives up after 4 retransmissions (~6 s). A live
# engine's kernel answers the probes however long it computes, so long generations still finish. nginx takes them
# as its network namespace's sysctls, the built-in proxy (runtime/proxy.py) as socket options.
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES, RETRIES = 2, 2, 3, 4  # seconds, seconds, count, count
LB_SYSCTLS = (("net.ipv4.tcp_keepalive_intvl", str(KEEPALIVE_INTERVAL)),
              ("net.ipv4.tcp_keepalive_probes", str(KEEPALIVE_PROBES)),
              ("net.ipv4.tcp_keepalive_time", str(KEEPALIVE_IDLE)), ("net.ipv4.tcp_retries2", str(RETRIES)))
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
    publish: str | None  # address:host port:container port; None = reachable only on its networks
    networks: tuple[str, ...]  # roles (INTERNAL, EDGE); the first is the one it is created on
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
    sysctls: tuple[tuple[str, str], ...] = ()  # of its own network namespace

    @property
    def labels(self) -> tuple[tuple[str, str], ...]:
        replica = "lb" if self.replica is None else str(self.replica)
        return (("deploykit.deployment", self.deployment), ("deploykit.replica", replica))


@dataclass(frozen=True, slots=True)
class ModelMount:
    """How the model reaches the containers: the host variable the scripts read its path from, and where it
    appears inside (a directory at /model, or one .gguf file inside /model)."""

    variable: str  # MODEL_DIR | MODEL_FILE
    target: str
    what: str  # "directory" | "file", for the scripts' comments


def model_mount(plan: Plan) -> ModelMount:
    if plan.model.is_file:
        return ModelMount("MODEL_FILE", f"{MODEL_DIR}/{(plan.model.path or 'model.gguf').rsplit('/', 1)[-1]}", "file")
    return ModelMount("MODEL_DIR", MODEL_DIR, "directory")


def seccomp_file(plan: Plan) -> str | None:
    mode = plan.security.seccomp
    return "seccomp.json" if mode == "least-privilege" else "unconfined" if mode == "unconfined" else None


def engine_caps(plan: Plan) -> tuple[str, ...]:
    """Capabilities added to an engine container after dropping ALL: none, unless the spec opts into SYS_NICE (NUMA
    binding needs no capability under the least-privilege seccomp profile)."""
    return ("SYS_NICE",) if plan.security.sys_nice else ()


def lb_name(plan: Plan) -> str:
    return f"{plan.name}-lb"


def network_name(deployment: str, role: str) -> str:
    """The Docker network of a role for run.sh and `deploykit up` (compose prefixes the role with its project)."""
    return f"{deployment}-{role}"


# The internal network's bridge gets no address on the host: without one the engines cannot reach even the host's
# own services (an internal network alone only stops forwarding beyond it).
INTERNAL_OPTIONS = (("com.docker.network.bridge.inhibit_ipv4", "true"),)


def healthcheck(port: int) -> tuple[str, ...]:
    """Exec form, no shell: python is in every image we build; curl is not."""
    code = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=4)"
    return ("python", "-c", code)


def replica_env(r: Replica) -> tuple[tuple[str, str], ...]:
    """The replica's placement as its container's environment: what doctor and people read in `docker inspect`, and
    what the engine binds to when it runs without the plan (DEPLOYKIT_CPUS and friends, see engine.server.options).
    OMP_NUM_THREADS sizes any OpenMP library loaded before the engine binds its own threads."""
    return (("DEPLOYKIT_CPUS", cpulist.format(r.cpus)), ("DEPLOYKIT_FRONTEND_CPUS", cpulist.format(r.frontend_cpus)),
            ("DEPLOYKIT_MEMS", cpulist.format(r.mems)), ("OMP_NUM_THREADS", str(r.omp_threads)))


def containers(plan: Plan) -> tuple[Container, ...]:
    user = f"{plan.security.run_as_user}:{plan.security.run_as_user}"
    sec = seccomp_file(plan)
    port = plan.serving.port
    out = []
    for r in plan.replicas:
        env = [*replica_env(r), ("DEPLOYKIT_REPLICA", str(r.index))]
        if plan.serving.api_key_env:
            env.append((plan.serving.api_key_env, None))
        out.append(Container(
            name=r.name, deployment=plan.name, comment=_describe(r), replica=r.index, cpuset=cpulist.format(r.cpuset),
            mems=cpulist.format(r.mems), memory=r.memory_limit_bytes, env=tuple(sorted(env)),
            mounts=(Mount("model", model_mount(plan).target), Mount("plan.json", PLAN_PATH)), publish=None,
            networks=(INTERNAL,), caps_add=engine_caps(plan), seccomp=sec, user=user,
            read_only=plan.security.read_only_root, tmpfs=TMPFS, shm_size=SHM_SIZE, stop_seconds=ENGINE_STOP_SECONDS))
    front = sorted({c for r in plan.replicas for c in r.frontend_cpus})
    replicas = "replicas" if len(plan.replicas) > 1 else "replica"
    out.append(Container(
        name=lb_name(plan), deployment=plan.name, replica=None,
        comment=f"nginx load balancer (least connections, streaming) in front of the {replicas}, the only published "
                "port; runs from the engine image, so nothing is pulled from a registry",
        cpuset=cpulist.format(front) if front else None, mems=None, memory=LB_MEMORY, env=(),
        mounts=(Mount("nginx.conf", NGINX_CONF),), publish=f"{plan.serving.publish_address}:{port}:{port}",
        networks=(EDGE, INTERNAL), caps_add=(), seccomp=sec, user=user, read_only=True, tmpfs=LB_TMPFS,
        shm_size=None, entrypoint=("/usr/sbin/nginx", "-e", "stderr", "-c", NGINX_CONF),
        depends_on=tuple(r.name for r in plan.replicas),
        # SIGQUIT is nginx's graceful stop: open streams run to the end while the replicas drain.
        stop_seconds=ENGINE_STOP_SECONDS, stop_signal="SIGQUIT", sysctls=LB_SYSCTLS))
    return tuple(out)


def _describe(r: Replica) -> str:
    nodes = f"NUMA node{'s' if len(r.numa_nodes) > 1 else ''} {cpulist.format(r.numa_nodes)}"
    front = (f"front end on CPUs {cpulist.format(r.frontend_cpus)}" if r.frontend_cpus
             else "front end shares those CPUs")
    threads = f"{r.omp_threads} OpenMP thread{'s' if r.omp_threads > 1 else ''}"
    mems = f"node{'s' if len(r.mems) > 1 else ''} {cpulist.format(r.mems)}"
    return (f"replica {r.index} on {nodes}: inference CPUs {cpulist.format(r.cpus)} ({threads}), {front}; "
            f"memory on {mems}, limit {human(r.memory_limit_bytes)}")
