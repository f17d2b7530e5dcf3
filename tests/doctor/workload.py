"""A stand-in for an inference server, for doctor's live tests: matmuls on PyTorch's OpenMP pool until killed.

`python workload.py`            compute in this process;
`python workload.py --launcher` act like a server's front end: import torch here (loading libgomp with whatever
                                affinity the environment asks for), then start the compute worker as a child
                                process whose environment drops the OpenMP affinity variables, as launchers that
                                "let the worker decide" do. The worker inherits the front end's CPU affinity.
Prints "ready" once the pool is working.
"""

import os
import subprocess
import sys
import time

import torch


def compute() -> None:
    x = torch.randn(768, 768)
    print("ready", flush=True)
    while True:
        x = torch.tanh(x @ x)


if __name__ == "__main__":
    if "--launcher" in sys.argv:
        torch.ones(8, 8) @ torch.ones(8, 8)
        env = {k: v for k, v in os.environ.items() if k not in ("GOMP_CPU_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND")}
        child = subprocess.Popen([sys.executable, __file__], env=env, stdout=sys.stdout)
        try:
            while child.poll() is None:
                time.sleep(0.5)
        finally:
            child.kill()
    else:
        compute()
