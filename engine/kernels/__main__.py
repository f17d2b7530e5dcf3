"""`python -m engine.kernels {build, status}`: compile the native kernels ahead of time, or print which matmul path
is active as JSON. One command table (deploykit.commands), like the other CLIs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from deploykit.commands import Tool, arg

cli = Tool("python -m engine.kernels", "the engine's native kernels", errors=RuntimeError,
           describe=lambda e: f"error: {e}", exit_code=lambda e: 1)


@cli.command("build", "compile the native kernels into the cache dir",
             arg("--dir", type=Path,
                 help="output dir (default: $DEPLOYKIT_KERNEL_DIR or ~/.cache/deploykit/kernels/...)"),
             arg("--force", action="store_true", help="rebuild even if an up-to-date build exists"))
def _build(args) -> int:
    from engine.kernels import build
    result = build.build(args.dir, force=args.force)
    verb = "built" if result.seconds else "up to date"
    print(json.dumps({"result": verb, "directory": str(result.directory), "seconds": round(result.seconds, 2)}))
    if args.dir is not None and os.environ.get("DEPLOYKIT_KERNEL_DIR") != str(args.dir):
        print(f"note: set DEPLOYKIT_KERNEL_DIR={args.dir} so the engine finds this build", file=sys.stderr)
    return 0


@cli.command("status", "print which matmul path is active, as JSON")
def _status(args) -> int:
    import engine.kernels
    print(json.dumps(engine.kernels.status(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
