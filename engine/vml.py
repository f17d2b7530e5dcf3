"""oneMKL VML's dispatch, resolved on one thread before any parallel use (pytorch/pytorch#188792).

ATen computes contiguous float/double `cos`, `sin`, `exp`, `sqrt`, `tanh`, ... with oneMKL's VML, each intra-op
thread on its chunk, asking for the high-accuracy kernels (`VML_HA`). oneMKL picks a function's kernel lazily, on
its first call. When that first call runs on several threads at once, one thread can run a low-accuracy kernel for
its whole chunk of that one call, silently. The engine hits this at start-up: the binding starts the OpenMP pool
before the model loads, and the rotary tables' `cos` over [max_len, D/2] is then often the process's first VML call.
Measured on this project's hosts, 2 CPUs: about 1 server start in 6 got cos tables ~1.5e-4 off (1,000s of ulp)
in the first thread's half, so the same prompt gave other logits in that process (SmolLM2's "What is 2 + 2?" ran
to max_tokens instead of stopping). One call of each function on one element, on this thread, settles every
function's dispatch; later calls compute the same bits they always did, fast. The upstream fix (the same
warm-up in ATen) is not in torch 2.13.
"""
from __future__ import annotations

import torch

# The functions ATen routes to VML (`IMPLEMENT_VML_MKL` in the installed torch's include/ATen/cpu/vml.h; a test
# checks that this list covers them), with an argument inside every one's domain.
FUNCTIONS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin", "sqrt",
             "tan", "tanh", "trunc")
_resolved = False


def resolve() -> bool:
    """Call every VML function once on one element of float32 and float64, on the calling thread (one element is
    below ATen's parallel grain, so no other thread joins). Once per process; True if this call did it."""
    global _resolved
    if _resolved:
        return False
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for name in FUNCTIONS:
            getattr(torch, name)(x)
    _resolved = True
    return True
