"""Command line: `python -m engine {tiny-model,generate,...}`; subcommands live in one table."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from engine.server import launch as _server_launch


def _tiny_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="output directory")
    p.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3", "opt"])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--rope-scaling", choices=["llama3"], default=None)
    p.add_argument("--max-shard-size", default=None, help="e.g. 200MB: write sharded safetensors")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def _tiny_model(a: argparse.Namespace) -> int:
    from engine.tinymodel import make_tiny_model
    make_tiny_model(a.dir, a.arch, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                    intermediate=a.intermediate, head_dim=a.head_dim, seed=a.seed, dtype=a.dtype,
                    max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings,
                    rope_scaling=a.rope_scaling, max_shard_size=a.max_shard_size)
    print(a.dir)
    return 0


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="Hugging Face model directory")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")


def _generate(a: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams
    engine = Engine(EngineConfig(a.model, dtype=a.dtype))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
    for prompt, c in zip(a.prompts, engine.generate(a.prompts, params)):
        print(f"{prompt!r} -> {c.text!r} [{c.finish_reason}, {len(c.token_ids)} tokens]")
    return 0


# name -> (help, add_arguments, run). Other modules register more subcommands by adding entries here.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "tiny-model": ("write a random-weight HF model directory (no download)", _tiny_model_args, _tiny_model),
    "generate": ("generate completions for prompts", _generate_args, _generate),
    "serve": ("run the OpenAI-compatible HTTP server", _server_launch.add_arguments, _server_launch.run_args),
}


def main(argv: list[str] | None = None) -> int:
    from engine.errors import EngineError
    parser = argparse.ArgumentParser(prog="python -m engine", description="deploykit CPU inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        add_args(p)
        p.set_defaults(run=run)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
