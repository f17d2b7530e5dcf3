"""EngineCore: token-level request lifecycle; each step() = schedule -> run the model -> sample -> finish."""
from __future__ import annotations

import itertools
import logging
import time

import torch

from deploykit import memory, modelconfig
from deploykit.errors import DeploykitError
from engine import vml
from engine.config import EngineConfig, dtype_name, mem_available_bytes
from engine.errors import ModelLoadError, RequestError
from engine.grammar import Grammars
from engine.kv_cache import BlockAllocator, KVCache
from engine.loader import load_config
from engine.messages import EngineStats, TokenOutput
from engine.model_runner import ModelRunner
from engine.models import build_model, is_native
from engine.params import check_prompt
from engine.sampling import Sampler, SamplingParams, SamplingState
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence

log = logging.getLogger("engine")
# Without a planned KV budget the cache takes at most this share of the memory free at start-up.
DEFAULT_KV_SHARE = 4
# A run of decode steps in one call (config.decode_steps) lasts about this long at most: a request arriving meanwhile
# waits for it, and a stream gets its tokens in runs. The Python a step saves (~0.3 ms on 2 vCPUs) matters only where
# a step is short: the benchmark model's Q4_0 token takes ~5 ms there, a 7B model's several times as long.
RUN_SECONDS = 0.025


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        vml.resolve()  # before the model's first parallel cos (its rotary tables): engine/vml.py says why
        torch.manual_seed(config.seed)
        self.dtype_name = dtype_name(config.dtype)  # "bfloat16" | "float32"
        self.dtype = getattr(torch, self.dtype_name)
        self.model_config = mc = load_config(config.model)
        try:
            self.max_model_len = modelconfig.context_length(mc.max_position_embeddings, config.max_model_len)
        except DeploykitError as e:  # the shared rule's error, re-raised in the engine's family
            raise ModelLoadError(f"{mc.source}: {e}") from None
        bytes_per_token = memory.kv_bytes_per_token(mc.kv_elements_per_token, self.dtype_name)
        budget = config.kv_cache_bytes or memory.auto_kv_cache_bytes(
            bytes_per_token, self.max_model_len, config.max_num_seqs, mem_available_bytes() // DEFAULT_KV_SHARE,
            at_least_one_sequence=False)
        num_blocks = budget // (bytes_per_token * config.block_size)
        if num_blocks < 1:
            raise ModelLoadError(f"kv_cache_bytes={budget} is too small: one block of {config.block_size} tokens "
                                 f"needs {bytes_per_token * config.block_size} bytes for this model")
        if num_blocks * config.block_size < self.max_model_len:
            log.warning("KV cache holds %d tokens, less than max_model_len %d; lowering max_model_len",
                        num_blocks * config.block_size, self.max_model_len)
            self.max_model_len = num_blocks * config.block_size
        self.model = build_model(mc, self.dtype, self.max_model_len, config.quantization, config.compact_weights,
                                 config.huge_pages)
        kv = KVCache(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                     self.dtype, config.huge_pages) if is_native(mc) else None
        # Prefix caching shares blocks of the paged pool; the transformers fallback keeps its own caches.
        self.allocator = BlockAllocator(num_blocks, config.block_size, config.prefix_caching and is_native(mc))
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, kv, config.block_size)
        self.sampler = Sampler()
        self.eos_token_ids = mc.eos_token_ids
        self.grammars = Grammars(config.model, mc.vocab_size, mc.eos_token_ids)  # built on first use
        self._requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._step_seconds = RUN_SECONDS  # the last fused decode step's time: how many fit in a run
        self.decode_steps = config.decode_steps  # the most a run takes (benchmarks/decode_profile.py --runs sets it)
        log.info("engine core: %s (%s, %s), max_model_len=%d, KV cache %d blocks x %d tokens (%.1f MiB), prefix "
                 "caching %s", mc.architecture, "native" if is_native(mc) else "transformers", self.dtype_name,
                 self.max_model_len, num_blocks, config.block_size, num_blocks * config.block_size
                 * bytes_per_token / 2**20, "on" if self.allocator.prefix_caching else "off")
        _log_kernels(self.dtype, getattr(self.model, "step_max_rows", 0)
                     if getattr(self.model, "step_weights", None) is not None else 0)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        vocab = self.model_config.vocab_size
        max_tokens = check_prompt(prompt_token_ids, params.max_tokens, vocab_size=vocab,
                                  max_model_len=self.max_model_len)
        n = len(prompt_token_ids)
        state = SamplingState(params, prompt_token_ids, self.eos_token_ids, vocab, self.grammars)
        seq = Sequence(request_id, list(prompt_token_ids), n, max_tokens, state, next(self._arrivals))
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        self._prompt_tokens += n

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its KV blocks; returns False if it was unknown or already finished."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self.runner.release(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        """Schedule, run the model, sample: each scheduled sequence's next token, or a run of them (_run_steps)."""
        batch = self.scheduler.schedule(self._run_steps())
        for seq in batch.preempted:
            self.runner.release(seq)
        if not batch:
            return []
        stops = None
        if batch.steps > 1:  # a run ends after a step that picks a token the sampler may ban or that may end a request
            stops = torch.tensor(sorted({t for seq in batch.seqs for t in seq.sampling.ending_ids}), dtype=torch.int64)
        start = time.perf_counter()
        sampled, logits, greedy = self.runner.execute(batch, stops)
        ran = 1 if greedy is None else greedy.shape[0]
        if greedy is not None:
            self._step_seconds = (time.perf_counter() - start) / ran
        self.scheduler.computed(batch, ran)
        if not sampled:
            return []
        new: dict[Sequence, list[int]] = {seq: [] for seq in sampled}
        for row in greedy[:-1].tolist() if ran > 1 else ():  # a run's steps before its last: none picked a stop
            for seq, token in zip(sampled, row):
                if seq.status is SeqStatus.RUNNING:
                    self._accept(seq, token, new[seq])
        result = self.sampler(logits, [seq.sampling for seq in sampled], None if greedy is None else greedy[-1])
        outputs = []
        for seq, token, lp in zip(sampled, result.token_ids, result.logprobs):
            if seq.status is SeqStatus.RUNNING:
                self._accept(seq, token, new[seq])
            outputs.append(TokenOutput(seq.request_id, tuple(new[seq]), None if lp is None else (lp,),
                                       seq.status is SeqStatus.FINISHED, seq.finish_reason))
        return outputs

    def _run_steps(self) -> int:
        """How many decode steps the next call may run at once (config.decode_steps): several only where every running
        sequence is plain greedy (its argmax is its token unless a ban hits it; a run ends after a step that picks an
        EOS or stop token, which the sampler then takes up) and none reaches max_tokens or max_model_len within the
        run, and as many as take about RUN_SECONDS at the last decode step's pace."""
        steps = min(self.decode_steps, max(1, int(RUN_SECONDS / self._step_seconds)))
        running = self.scheduler.running
        if steps == 1 or not running or len(running) > getattr(self.model, "step_logits_rows", 0):
            return 1
        for seq in running:
            if not seq.sampling.plain_greedy:
                return 1
            steps = min(steps, seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        return max(steps, 1)

    def _accept(self, seq: Sequence, token: int, new: list[int]) -> None:
        """Append a generated token to seq; finish it if that token ends it."""
        seq.token_ids.append(token)
        seq.sampling.append(token)
        new.append(token)
        self._generation_tokens += 1
        reason = self._finish_reason(seq, token)
        if reason is not None:
            del self._requests[seq.request_id]
            self.scheduler.finish(seq, reason)
            self.runner.release(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.sampling.params
        if seq.sampling.complete:  # its grammar admits nothing more
            return "stop"
        if seq.num_output_tokens > p.min_tokens:  # a stop token counts only once min_tokens were produced
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                return "stop"
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def stats(self) -> EngineStats:
        a = self.allocator
        return EngineStats(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                           kv_cache_usage=a.usage(), prompt_tokens_total=self._prompt_tokens,
                           generation_tokens_total=self._generation_tokens,
                           num_preemptions=self.scheduler.num_preemptions, kv_blocks_total=a.num_blocks,
                           kv_blocks_active=a.num_active, kv_blocks_cached=a.num_cached,
                           prefix_cache_queries_total=a.queries, prefix_cache_hits_total=a.hits)


def _log_kernels(dtype: torch.dtype, fused_step: int) -> None:
    """Say which matmul path runs: a missing or stale kernel library must not slow bf16 decode down silently.
    fused_step: the most sequences the fused decode step takes (0: it does not run)."""
    from engine import kernels
    st = kernels.status()
    if dtype != torch.bfloat16:
        log.info("matmul path: PyTorch (%s weights; the native matmuls serve bf16)%s%s", str(dtype)[6:],
                 f"; quantized weights on the {st['variant']} build's int8 kernels" if st["quantized"] else "",
                 "; norms, rotary, SiLU and decode attention native" if st["fp32_ops"] and dtype == torch.float32
                 else "")
    elif st["path"] == "fallback" and "engine.kernels build" in st["reason"]:  # fixable: not built or stale
        log.warning("matmul path: PyTorch fallback, bf16 decode runs ~2x slower: %s", st["reason"])
    else:
        log.info("matmul path: %s (%s)", st["path"], st["reason"])
    if dtype == torch.bfloat16 and (choice := kernels.tune_streams()) is not None:
        log.info("bf16 GEMV: %s", choice.describe())
    if fused_step:
        log.info("decode steps of up to %d sequences run as one fused native call", fused_step)
