"""Our seccomp syscall table: Docker's default profile semantics, plus NUMA binding and page migration for everyone.

Rules are data. `Rule.why` (and `DENIED` / `WHY`) carry a one-line reason wherever we deviate from
Docker's current default profile (moby profiles/seccomp/default.json) or from containers-common's
seccomp.json. Only x86_64 and aarch64 hosts are covered.
"""

from __future__ import annotations

from dataclasses import dataclass

ALLOW = "SCMP_ACT_ALLOW"
ERRNO = "SCMP_ACT_ERRNO"
EPERM = 1
ENOSYS = 38
AF_VSOCK = 40
# CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET: clone() may not create namespaces.
CLONE_NS_FLAGS = 0x7E020000

# Docker's archMap: native arch -> the subarches whose syscall ABIs the filter also covers.
ARCH_MAP: dict[str, tuple[str, ...]] = {
    "SCMP_ARCH_X86_64": ("SCMP_ARCH_X86", "SCMP_ARCH_X32"),
    "SCMP_ARCH_AARCH64": ("SCMP_ARCH_ARM",),
}
# Host arch (uname -m) -> (Docker/Go arch name used by `includes.arches`, native seccomp arch).
HOST_ARCHES: dict[str, tuple[str, str]] = {
    "x86_64": ("amd64", "SCMP_ARCH_X86_64"),
    "aarch64": ("arm64", "SCMP_ARCH_AARCH64"),
}
NUMA = frozenset({"get_mempolicy", "mbind", "set_mempolicy", "set_mempolicy_home_node",
                  "migrate_pages", "move_pages"})


@dataclass(frozen=True, slots=True)
class Arg:
    """One argument comparison; all Args of a Rule must hold (logical AND)."""

    index: int
    value: int
    op: str
    value_two: int = 0


@dataclass(frozen=True, slots=True)
class Rule:
    names: tuple[str, ...]
    action: str = ALLOW
    caps: tuple[str, ...] = ()         # rule applies only if ALL are held (Docker `includes.caps`)
    unless_caps: tuple[str, ...] = ()  # rule dropped if ANY is held (Docker `excludes.caps`)
    arches: tuple[str, ...] = ()       # Go arch names the rule is limited to (Docker `includes.arches`)
    args: tuple[Arg, ...] = ()
    errno: int | None = None
    why: str = ""                      # set only where we deviate from Docker's default

    def applies(self, caps: frozenset[str], go_arch: str) -> bool:
        if not set(self.caps) <= caps or caps & set(self.unless_caps):
            return False
        return not self.arches or go_arch in self.arches


# Allowed for everyone. Docker's unconditional list minus DENIED below.
_BASE = """
accept accept4 access adjtimex alarm bind brk capget capset chdir chmod chown chown32 clock_adjtime
clock_adjtime64 clock_getres clock_getres_time64 clock_gettime clock_gettime64 clock_nanosleep
clock_nanosleep_time64 close close_range connect copy_file_range creat dup dup2 dup3 epoll_create
epoll_create1 epoll_ctl epoll_ctl_old epoll_pwait epoll_pwait2 epoll_wait epoll_wait_old eventfd eventfd2
execve execveat exit exit_group faccessat faccessat2 fadvise64 fadvise64_64 fallocate fanotify_mark fchdir
fchmod fchmodat fchmodat2 fchown fchown32 fchownat fcntl fcntl64 fdatasync fgetxattr flistxattr flock fork
fremovexattr fsetxattr fstat fstat64 fstatat64 fstatfs fstatfs64 fsync ftruncate ftruncate64 futex
futex_time64 futimesat get_robust_list get_thread_area getcpu getcwd getdents getdents64 getegid getegid32
geteuid geteuid32 getgid getgid32 getgroups getgroups32 getitimer getpeername getpgid getpgrp getpid getppid
getpriority getrandom getresgid getresgid32 getresuid getresuid32 getrlimit getrusage getsid getsockname
getsockopt gettid gettimeofday getuid getuid32 getxattr inotify_add_watch inotify_init inotify_init1
inotify_rm_watch io_cancel io_destroy io_getevents io_setup io_submit ioctl ioprio_get ioprio_set ipc kill
landlock_add_rule landlock_create_ruleset landlock_restrict_self lchown lchown32 lgetxattr link linkat
listen listxattr llistxattr _llseek lremovexattr lseek lsetxattr lstat lstat64 madvise membarrier
memfd_create memfd_secret mincore mkdir mkdirat mknod mknodat mlock mlock2 mlockall mmap mmap2 mprotect
mq_getsetattr mq_notify mq_open mq_timedreceive mq_timedreceive_time64 mq_timedsend mq_timedsend_time64
mq_unlink mremap msgctl msgget msgrcv msgsnd msync munlock munlockall munmap name_to_handle_at nanosleep
newfstatat _newselect open openat openat2 pause pidfd_open pidfd_send_signal pipe pipe2 pkey_alloc
pkey_free pkey_mprotect poll ppoll ppoll_time64 prctl pread64 preadv preadv2 prlimit64 process_mrelease
pselect6 pselect6_time64 pwrite64 pwritev pwritev2 read readahead readlink readlinkat readv recv recvfrom
recvmmsg recvmmsg_time64 recvmsg remap_file_pages removexattr rename renameat renameat2 restart_syscall
rmdir rseq rt_sigaction rt_sigpending rt_sigprocmask rt_sigqueueinfo rt_sigreturn rt_sigsuspend
rt_sigtimedwait rt_sigtimedwait_time64 rt_tgsigqueueinfo sched_get_priority_max sched_get_priority_min
sched_getaffinity sched_getattr sched_getparam sched_getscheduler sched_rr_get_interval
sched_rr_get_interval_time64 sched_setaffinity sched_setattr sched_setparam sched_setscheduler sched_yield
seccomp select semctl semget semop semtimedop semtimedop_time64 send sendfile sendfile64 sendmmsg sendmsg
sendto set_robust_list set_thread_area set_tid_address setfsgid setfsgid32 setfsuid setfsuid32 setgid
setgid32 setgroups setgroups32 setitimer setpgid setpriority setregid setregid32 setresgid setresgid32
setresuid setresuid32 setreuid setreuid32 setrlimit setsid setsockopt setuid setuid32 setxattr shmat
shmctl shmdt shmget shutdown sigaltstack signalfd signalfd4 sigprocmask sigreturn socketcall socketpair
splice stat stat64 statfs statfs64 statx symlink symlinkat sync sync_file_range syncfs sysinfo tee tgkill
time timer_create timer_delete timer_getoverrun timer_gettime timer_gettime64 timer_settime
timer_settime64 timerfd_create timerfd_gettime timerfd_gettime64 timerfd_settime timerfd_settime64 times
tkill truncate truncate64 ugetrlimit umask uname unlink unlinkat utime utimensat utimensat_time64 utimes
vfork wait4 waitid waitpid write writev
"""
BASE: tuple[str, ...] = tuple(sorted(_BASE.split()))

# Docker allows these unconditionally (or on kernel >= 4.8); we do not. Our engine is Python + torch +
# OpenMP + sockets: none of these is on its path, so each is attack surface only.
_URING = "io_uring runs the calls it multiplexes past seccomp; Docker >= 25 dropped it too"
_FUTEX2 = "futex2 API unused by glibc, libgomp and torch (they use futex); newer containers-common denies it"
_PTRACE = "Docker allows it on kernel >= 4.8 without caps; the server never traces, so CAP_SYS_PTRACE only"
DENIED: dict[str, str] = {
    "io_uring_setup": _URING,
    "io_uring_enter": _URING,
    "io_uring_register": _URING,
    "io_pgetevents": "Linux AIO with signal masks; nothing in our stack uses AIO; containers-common denies it",
    "io_pgetevents_time64": "32-bit twin of io_pgetevents; containers-common denies it",
    "vmsplice": "page-splicing primitive with a CVE history; unused by Python; containers-common denies it",
    "futex_waitv": _FUTEX2,
    "futex_wait": _FUTEX2,
    "futex_wake": _FUTEX2,
    "futex_requeue": _FUTEX2,
    "cachestat": "page-cache residency query (a side channel on shared files); newer containers-common denies it",
    "map_shadow_stack": "only ucontext coroutines under CET shadow stacks need it; the kernel maps thread stacks",
    "ptrace": _PTRACE,
    "process_vm_readv": _PTRACE,
    "process_vm_writev": _PTRACE,
}

# Allowed by us but absent from containers-common 0.50's allow list (beyond the NUMA calls).
WHY: dict[str, str] = {
    "fchmodat2": "fchmodat with flags, no new power; glibc >= 2.39 calls it first and won't fall back on EPERM",
}

# The kernel checks CAP_SYS_NICE for these only when they touch other processes' pages (MPOL_MF_MOVE_ALL,
# migrate_pages/move_pages of another pid or uid); on the caller's own memory they need no capability (measured
# as uid 65534 with CapEff 0). Docker gates the first four on CAP_SYS_NICE and denies the last two outright, which
# is the only reason containers were given SYS_NICE (fails Pod Security baseline) or seccomp=unconfined.
_NUMA_WHY = ("NUMA binding of the engine's own memory (set_mempolicy/mbind, numa_migrate_pages); the kernel itself "
             "needs CAP_SYS_NICE only for other processes' pages, so no capability is granted for it")
_ADMIN = ("CAP_SYS_ADMIN",)

# Conditional rules, in Docker's order; the NUMA rule is ours (Docker's holds the first four under CAP_SYS_NICE).
RULES: tuple[Rule, ...] = (
    Rule(("socket",), args=(Arg(0, AF_VSOCK, "SCMP_CMP_NE"),)),
    # personality: only the Linux, Linux32 and UNAME26 personas, and the query value 0xffffffff.
    *(Rule(("personality",), args=(Arg(0, v, "SCMP_CMP_EQ"),)) for v in (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)),
    Rule(("arm_fadvise64_64", "arm_sync_file_range", "breakpoint", "cacheflush", "set_tls", "sync_file_range2"),
         arches=("arm", "arm64")),
    Rule(("arch_prctl",), arches=("amd64", "x32")),
    Rule(("modify_ldt",), arches=("amd64", "x32", "x86")),
    Rule(("open_by_handle_at",), caps=("CAP_DAC_READ_SEARCH",)),
    Rule(("bpf", "clone", "clone3", "fanotify_init", "fsconfig", "fsmount", "fsopen", "fspick", "lookup_dcookie",
          "mount", "mount_setattr", "move_mount", "open_tree", "perf_event_open", "quotactl", "quotactl_fd",
          "setdomainname", "sethostname", "setns", "syslog", "umount", "umount2", "unshare"), caps=_ADMIN),
    Rule(("clone",), unless_caps=_ADMIN, args=(Arg(0, CLONE_NS_FLAGS, "SCMP_CMP_MASKED_EQ", 0),)),
    # ENOSYS, not EPERM: glibc >= 2.34 tries clone3 first and falls back to clone only on ENOSYS.
    Rule(("clone3",), action=ERRNO, errno=ENOSYS, unless_caps=_ADMIN),
    Rule(("reboot",), caps=("CAP_SYS_BOOT",)),
    Rule(("chroot",), caps=("CAP_SYS_CHROOT",)),
    Rule(("delete_module", "finit_module", "init_module"), caps=("CAP_SYS_MODULE",)),
    Rule(("acct",), caps=("CAP_SYS_PACCT",)),
    Rule(("kcmp", "pidfd_getfd", "process_madvise", "process_vm_readv", "process_vm_writev", "ptrace"),
         caps=("CAP_SYS_PTRACE",)),
    Rule(("ioperm", "iopl"), caps=("CAP_SYS_RAWIO",)),
    Rule(("clock_settime", "clock_settime64", "settimeofday", "stime"), caps=("CAP_SYS_TIME",)),
    Rule(("vhangup",), caps=("CAP_SYS_TTY_CONFIG",)),
    Rule(tuple(sorted(NUMA)), why=_NUMA_WHY),
    Rule(("syslog",), caps=("CAP_SYSLOG",)),
    Rule(("bpf",), caps=("CAP_BPF",)),
    Rule(("perf_event_open",), caps=("CAP_PERFMON",)),
)


def resolve(caps: frozenset[str], arch: str) -> tuple[Rule, ...]:
    """The rules in force for a container holding exactly `caps` on host `arch` (uname -m)."""
    go_arch = HOST_ARCHES[arch][0]
    return (Rule(BASE),) + tuple(r for r in RULES if r.applies(caps, go_arch))


def allowed_names(caps: frozenset[str], arch: str) -> frozenset[str]:
    """Syscall names reachable (unconditionally or for some arguments) under `caps` on `arch`."""
    return frozenset(n for r in resolve(caps, arch) if r.action == ALLOW for n in r.names)


def justification(name: str) -> str:
    """Why we deviate from Docker or containers-common for `name`; '' when we do not."""
    for rule in RULES:
        if name in rule.names and rule.why:
            return rule.why
    return DENIED.get(name) or WHY.get(name, "")
