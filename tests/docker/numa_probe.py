"""Probe which syscalls a container may make; prints one JSON object on stdout.

Runs inside the container (`python3 - < numa_probe.py`), stdlib only. Each call gets arguments the
kernel accepts, or, for the calls that must stay denied, arguments the kernel rejects with an errno
other than EPERM *before* any capability check. So EPERM means "seccomp said no" and anything else means
the kernel saw the call: compare with a `seccomp=unconfined` run to be sure.
"""

import ctypes
import json
import mmap
import os
import platform

NR = {  # (x86_64, aarch64) syscall numbers
    "get_mempolicy": (239, 236), "set_mempolicy": (238, 237), "mbind": (237, 235),
    "migrate_pages": (256, 238), "move_pages": (279, 239), "mount": (165, 40),
    "unshare": (272, 97), "ptrace": (101, 117), "kexec_load": (246, 104), "bpf": (321, 280),
}
ARCH = {"x86_64": 0, "aarch64": 1}[platform.machine()]
MPOL_DEFAULT = 0
MPOL_BIND = 2
MPOL_MF_MOVE = 1 << 1  # move this process's pages of the range (MPOL_MF_MOVE_ALL would need CAP_SYS_NICE)
PTRACE_PEEKUSER = 3

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ulong = ctypes.c_ulong


def call(name, *args):
    """0 if the syscall returned >= 0, else its errno."""
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(NR[name][ARCH]), *args)
    return 0 if ret >= 0 else ctypes.get_errno()


def mems_allowed():
    for line in open("/proc/self/status"):
        if line.startswith("Mems_allowed_list:"):
            out = []
            for part in line.split()[1].split(","):
                lo, _, hi = part.partition("-")
                out += range(int(lo), int(hi or lo) + 1)
            return out
    return [0]


allowed_nodes = mems_allowed()
node = allowed_nodes[0]
nodemask = ulong(1 << node)
every_node = ulong(sum(1 << n for n in allowed_nodes))
maxnode = ulong(64)  # bits in nodemask; must exceed the highest node set
page = mmap.mmap(-1, mmap.PAGESIZE)
page.write(b"x")  # touch it so move_pages has a resident page to report
addr = ctypes.addressof(ctypes.c_char.from_buffer(page))

out = {}
mode = ctypes.c_int(-1)
out["get_mempolicy"] = call("get_mempolicy", ctypes.byref(mode), None, ulong(0), None, ulong(0))
# What the engine does at start-up: bind every future allocation to one node, bind (and move) a touched range,
# and migrate every page already touched on any allowed node to that node. Self only (pid 0).
out["set_mempolicy"] = call("set_mempolicy", MPOL_BIND, ctypes.byref(nodemask), maxnode)
bound = ctypes.c_int(-1)
bound_mask = ulong(0)
call("get_mempolicy", ctypes.byref(bound), ctypes.byref(bound_mask), maxnode, None, ulong(0))
out["mbind"] = call("mbind", ulong(addr), ulong(mmap.PAGESIZE), MPOL_BIND, ctypes.byref(nodemask),
                    maxnode, MPOL_MF_MOVE)
# Returns the number of pages it could not move (>= 0 is success).
out["migrate_pages"] = call("migrate_pages", 0, maxnode, ctypes.byref(every_node), ctypes.byref(nodemask))
call("set_mempolicy", MPOL_DEFAULT, None, ulong(0))
pages = (ctypes.c_void_p * 1)(addr)
status = (ctypes.c_int * 1)(-1)
target = (ctypes.c_int * 1)(node)
out["move_pages"] = call("move_pages", 0, ulong(1), pages, target, status, 0)  # our page to our node: a real move
# Bad `type` pointer: the kernel copies mount strings before checking CAP_SYS_ADMIN -> EFAULT.
out["mount"] = call("mount", None, b"/", ctypes.c_void_p(1), ulong(0), None)
out["unshare"] = call("unshare", 0)  # a no-op that succeeds when seccomp lets it through
# No such pid: ESRCH from the kernel before any permission check.
out["ptrace"] = call("ptrace", PTRACE_PEEKUSER, 0x3FFFFFFF, None, None)
out["kexec_load"] = call("kexec_load", ulong(0), ulong(0), None, ulong(0))
out["bpf"] = call("bpf", 0xFFFF, None, 0)  # unknown command: EINVAL from the kernel

status_lines = dict(line.rstrip("\n").split(":\t", 1) for line in open("/proc/self/status") if ":\t" in line)
try:
    with open("/deploykit-probe-write", "w"):
        pass
    root_write = 0
except OSError as e:
    root_write = e.errno

print(json.dumps({
    "syscalls": out,
    "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(),
    "root_write_errno": root_write,
    "cpus_allowed_list": status_lines.get("Cpus_allowed_list", "").strip(),
    "mems_allowed_list": status_lines.get("Mems_allowed_list", "").strip(),
    "seccomp_mode": status_lines.get("Seccomp", "").strip(),
    "no_new_privs": status_lines.get("NoNewPrivs", "").strip(),
    "cap_bnd": status_lines.get("CapBnd", "").strip(),
    "cap_eff": status_lines.get("CapEff", "").strip(),
    # the policy set_mempolicy left in force (when it was allowed): MPOL_BIND on our node
    "bound_policy": [bound.value, bound_mask.value],
    "moved_page_node": status[0],  # where move_pages left the page (a negative errno if it could not)
}, sort_keys=True))
