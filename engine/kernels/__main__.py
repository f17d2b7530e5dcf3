"""Command line for the native kernels: `build` them ahead of time, print `status` as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the native kernels into the cache dir")
    b.add_argument("--dir", type=Path, help="output dir (default: $DEPLOYKIT_KERNEL_DIR or ~/.cache/deploykit/kernels/...)")
    b.add_argument("--force", action="store_true", help="rebuild even if an up-to-date build exists")
    sub.add_parser("status", help="print which matmul path is active, as JSON")
    args = parser.parse_args(argv)

    if args.command == "build":
        from engine.kernels import build

        result = build.build(args.dir, force=args.force)
        verb = "built" if result.seconds else "up to date"
        print(json.dumps({"result": verb, "directory": str(result.directory), "seconds": round(result.seconds, 2)}))
        if args.dir is not None and os.environ.get("DEPLOYKIT_KERNEL_DIR") != str(args.dir):
            print(f"note: set DEPLOYKIT_KERNEL_DIR={args.dir} so the engine finds this build", file=sys.stderr)
        return 0

    import engine.kernels

    print(json.dumps(engine.kernels.status(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
