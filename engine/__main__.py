"""`python -m engine {tiny-model, generate, serve}`: one command table (deploykit.commands) and the engine's one
error -> exit-code table (engine.errors)."""
from __future__ import annotations

import argparse
import logging
import sys

from deploykit.commands import Tool, arg
from engine.errors import EngineError, exit_code
from engine.server import launch

cli = Tool("python -m engine", "deploykit CPU inference engine", errors=EngineError,
           describe=lambda e: f"error: {e}", exit_code=exit_code,
           setup=lambda: logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s"))


@cli.command("tiny-model", "write a random-weight HF model directory (no download)",
             arg("dir", help="output directory"),
             arg("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3", "opt"]),
             arg("--hidden", type=int, default=64), arg("--layers", type=int, default=2),
             arg("--heads", type=int, default=4), arg("--kv-heads", type=int, default=2),
             arg("--intermediate", type=int, default=128), arg("--head-dim", type=int, default=None),
             arg("--max-position-embeddings", type=int, default=2048),
             arg("--tie-word-embeddings", action="store_true"),
             arg("--rope-scaling", choices=["llama3"], default=None),
             arg("--max-shard-size", default=None, help="e.g. 200MB: write sharded safetensors"),
             arg("--seed", type=int, default=0), arg("--dtype", default="float32", choices=["float32", "bfloat16"]),
             arg("--chat-template", default="chatml", choices=["chatml", "qwen3", "llama3"],
                 help="chatml: plain; qwen3: tools, <tool_call> and <think>; llama3: tools as JSON calls"))
def _tiny_model(a: argparse.Namespace) -> int:
    from engine.tinymodel import make_tiny_model
    make_tiny_model(a.dir, a.arch, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                    intermediate=a.intermediate, head_dim=a.head_dim, seed=a.seed, dtype=a.dtype,
                    max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings,
                    rope_scaling=a.rope_scaling, max_shard_size=a.max_shard_size, chat_template=a.chat_template)
    print(a.dir)
    return 0


@cli.command("generate", "generate completions for prompts", arg("model", help="model directory or .gguf file"),
             arg("prompts", nargs="+"), arg("--max-tokens", type=int, default=32),
             arg("--temperature", type=float, default=0.0), arg("--seed", type=int, default=None),
             arg("--dtype", default="auto"))
def _generate(a: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.params import SamplingParams
    engine = Engine(EngineConfig(a.model, dtype=a.dtype))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
    for prompt, c in zip(a.prompts, engine.generate(a.prompts, params)):
        print(f"{prompt!r} -> {c.text!r} [{c.finish_reason}, {len(c.token_ids)} tokens]")
    return 0


@cli.command("serve", "run the OpenAI-compatible HTTP server", launch.add_arguments)
def _serve(a: argparse.Namespace) -> int:
    return launch.run_args(a)


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
