"""What the CPU computes: its flags from /proc/cpuinfo, the ISA tier they make, and whether bf16 is native.

The one home of these facts: the topology reader (plans for a host or a snapshot), the engine's dtype choice and
the native-kernel loader all ask here, so they can never disagree about a CPU.
"""

from __future__ import annotations

from pathlib import Path

# Flags worth carrying in a Topology or a plan (the rest of /proc/cpuinfo's list changes nothing we decide).
OF_INTEREST = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
               "amx_tile", "amx_bf16", "amx_int8")
# Tiers, best first: AMX tiles; AVX512-BF16 (vdpbf16ps); AVX-512 without bf16 units (bf16 widened in registers);
# AVX2; anything older.
TIERS = ("amx", "avx512_bf16", "avx512", "avx2", "baseline")
BF16_TIERS = frozenset({"amx", "avx512_bf16"})


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """Every flag of the first CPU in `cpuinfo` (a path); empty when it is unreadable or lists none."""
    try:
        return flags_in(Path(cpuinfo).read_text(errors="replace"))
    except OSError:
        return frozenset()


def flags_in(cpuinfo_text: str) -> frozenset[str]:
    for line in cpuinfo_text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def model_in(cpuinfo_text: str) -> str:
    """The first CPU's `model name` ("" when absent, e.g. on some ARM kernels)."""
    for line in cpuinfo_text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return ""


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The first CPU's model name from `cpuinfo` (a path); "" when unreadable."""
    try:
        return model_in(Path(cpuinfo).read_text(errors="replace"))
    except OSError:
        return ""


def tier(flags: frozenset[str] | set[str] | tuple[str, ...]) -> str:
    f = set(flags)
    if {"amx_tile", "amx_bf16"} <= f:
        return "amx"
    if "avx512_bf16" in f:
        return "avx512_bf16"
    if {"avx512f", "avx512bw", "avx512vl"} <= f:
        return "avx512"
    return "avx2" if "avx2" in f else "baseline"


# The native kernels' build variants (engine/kernels/build.py) and what each needs from the CPU.
KERNEL_BASE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
# The AVX2 build: its int8 GEMV for quantized weights uses FMA and F16C too, which every AVX2 CPU has (Haswell and
# later, Zen and later); a Topology keeps only OF_INTEREST flags, so rules over a plan's flags go by the avx2 tier.
AVX2_BASE = frozenset({"avx2", "fma", "f16c"})
FULL_VARIANTS = ("avx512bf16", "avx512")  # every native op; "avx2" holds the quantized-weight and fp32 ops only


def kernel_variant(flags: frozenset[str] | set[str] | tuple[str, ...]) -> str | None:
    """The native kernel build this CPU runs: vdpbf16ps where it reports avx512_bf16, the widening build on any
    other AVX-512 (F, BW, VL, DQ) CPU, the AVX2 build on AVX2 CPUs below that (its ops serve quantized weights,
    bf16 weights under fp32 activations, and fp32 norms, activations and decode attention; fp32 weights run on
    PyTorch's own ops), none below AVX2."""
    f = set(flags)
    if KERNEL_BASE <= f:
        return "avx512bf16" if "avx512_bf16" in f else "avx512"
    return "avx2" if AVX2_BASE <= f else None


def quantized_kernels(flags: frozenset[str] | set[str] | tuple[str, ...]) -> bool:
    """The native int8 kernels for block-quantized weights (GGUF Q8_0, Q4_0, Q4_K...) run here: an AVX-512 kernel
    build with AVX512-VNNI (vpdpbusd), or the AVX2 build on a CPU below AVX-512 (vpmaddubsw). Elsewhere (an AVX-512
    CPU without VNNI, such as Skylake-SP, or one without AVX2) the engine dequantizes such weights at load."""
    # By tier, not kernel_variant: a Topology keeps only OF_INTEREST flags (no avx512dq, which every VNNI CPU has).
    t = tier(flags)
    return (t in ("avx512", *BF16_TIERS) and "avx512_vnni" in set(flags)) or t == "avx2"


def fp32_kernels(flags: frozenset[str] | set[str] | tuple[str, ...]) -> bool:
    """Some native kernel build runs here (AVX2 or better), and with it the AVX2 + FMA code every build holds: the
    fp32 ops of a decoder layer, and the GEMM that keeps a bf16 checkpoint's matrices in bf16 under fp32 compute
    (engine/kernels/bf16w_linear.cpp). By tier, as quantized_kernels: a Topology keeps only OF_INTEREST flags."""
    return tier(flags) != "baseline"


def amx_granted() -> bool:
    """Whether the kernel lets this process use AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM, Linux >= 5.16).
    The cpuinfo flags only say the CPU has AMX; a kernel too old, or a hypervisor that does not expose the
    XTILEDATA state, refuses here and the engine's tile code must stay off."""
    import ctypes
    import platform

    if platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    return libc.syscall(ctypes.c_long(sys_arch_prctl), ctypes.c_int(arch_req_xcomp_perm),
                        ctypes.c_ulong(xfeature_xtiledata)) == 0


def has_bf16(flags: frozenset[str] | set[str] | tuple[str, ...]) -> bool:
    """bf16 runs on hardware units (vdpbf16ps or AMX tiles); otherwise it is widened or emulated."""
    return tier(flags) in BF16_TIERS


# Node Feature Discovery's CPUID label names (feature.node.kubernetes.io/cpu-cpuid.<NAME>, no underscores).
NFD_LABELS = {"avx2": "AVX2", "avx512f": "AVX512F", "avx512bw": "AVX512BW", "avx512vl": "AVX512VL",
              "avx512_vnni": "AVX512VNNI", "avx512_bf16": "AVX512BF16", "avx512_fp16": "AVX512FP16",
              "amx_tile": "AMXTILE", "amx_bf16": "AMXBF16", "amx_int8": "AMXINT8"}


def node_features(cpu_tier: str, dtype: str, quantized: bool = False) -> tuple[str, ...]:
    """NFD CPUID labels a node must have to run a plan made for `cpu_tier` as planned: AVX-512F for the native
    kernels, for bfloat16 the units that make it native on the planned machine (AVX512-BF16, AMX tiles), and
    AVX512-VNNI when weights are held quantized (the int8 kernels), so a pod never lands where bf16 is widened or
    emulated, or quantized weights would be dequantized, and runs several times slower than the plan assumed (and
    holds more than its memory limit was sized for). A plan made on an AVX2 CPU with quantized weights needs AVX2."""
    if cpu_tier == "avx2" and quantized:
        return (NFD_LABELS["avx2"],)
    if cpu_tier not in ("avx512", *BF16_TIERS):
        return ()
    flags = ["avx512f"] + (["avx512_vnni"] if quantized else [])
    if dtype == "bfloat16" and cpu_tier in BF16_TIERS:
        flags.append("avx512_bf16")
        if cpu_tier == "amx":
            flags.append("amx_bf16")
    return tuple(NFD_LABELS[f] for f in flags)
