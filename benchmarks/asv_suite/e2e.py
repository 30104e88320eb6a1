"""asv suite: end to end, the Llama-style model of benchmarks/peers/e2e_models.py (Llama 3.2 1B's
shape `e2e_models.LLAMA_1B`, random bf16 weights, built by the shape-taking
`e2e_kv_decode.build`), unmodified (`model` "transformers": transformers' SDPA attention)
against kernelized ("openkernels": `kernelize(model)`, mode="training" for the training
step; "openkernels-int4": int4 weights and the int4 KV cache, decode only).

- prefill: forward without cache, logits of the last position, batch 8 x 2048 tokens.
- train: forward with labels and backward, batch 4 x 2048 tokens.
- decode: greedy `generate()`, batch 1, 32-token prompt, 128 new tokens. "eager": the
  dynamic caches (transformers' DynamicCache, OpenKernelsCache for int4), generate()'s
  compile turned off; "compiled" (GPUs only: generate() compiles the decode step of a
  static cache on CUDA alone): transformers' static cache, OpenKernelsStaticCache.
  A compiled run that compiles no graph is an error, not an eager time.

The shapes are e2e_models'; on CPUs, and in smoke mode everywhere, the 2-layer model of
`e2e_kv_decode.py --tiny` on a few tokens, so a run takes seconds. `track_ms`: milliseconds
per step (decode: per generated token, the prompt's prefill included, as e2e_models
reports it); `track_tokens_per_s`: tokens per second (decode: generated tokens). Each
combination builds its own model (same seed) and times the median of a few runs after a
warm-up, the device waited for around each.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from . import _harness as _h

SCRIPTS = Path(__file__).resolve().parent.parent / "peers"
STEPS = ["prefill", "train", "decode"]
MODES = ["eager", "compiled"]
MODELS = ["transformers", "openkernels", "openkernels-int4"]
# (warm-up runs, timed runs) per step: e2e_models' counts.
RUNS = {"prefill": (2, 5), "train": (2, 5), "decode": (1, 3)}


def _script(name: str) -> ModuleType:
    """benchmarks/peers/<name>.py, imported by its path under its own name: asv puts only this
    package on the path, and the scripts import each other by bare name (e2e_kv_decode
    imports e2e_models, which is therefore loaded first)."""
    if name == "e2e_kv_decode":
        _script("e2e_models")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


@dataclass(frozen=True)
class Sizes:
    """The model's shape and each step's tokens."""

    model: dict[str, Any]
    prefill: tuple[int, int]  # batch, tokens
    train: tuple[int, int]  # batch, tokens
    decode: tuple[int, int, int]  # batch, prompt tokens, new tokens


def sizes(device_type: str) -> Sizes:
    """e2e_models' shapes on GPUs; the tiny model on CPUs and in smoke mode."""
    e2e_models = _script("e2e_models")
    tiny = _script("e2e_kv_decode").TINY
    if _h.smoke():
        return Sizes(tiny, (1, 16), (1, 16), (1, 8, 2))
    if device_type == "cuda":
        return Sizes(e2e_models.LLAMA_1B, (8, 2048), (4, 2048), (1, 32, 128))
    return Sizes(tiny, (2, 128), (2, 128), (1, 32, 16))


def _prefill(model: Any, ids: Any) -> Callable[[], Any]:
    import torch

    def run() -> Any:
        with torch.no_grad():
            return model(ids, use_cache=False, logits_to_keep=1).logits

    return run


def _train(model: Any, ids: Any) -> Callable[[], Any]:
    def step() -> Any:
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss

    return step


def _decode(model: Any, ids: Any, new: int, mode: str, variant: str) -> Callable[[], Any]:
    """generate() of `new` tokens; each call starts from a fresh cache of the variant."""
    import inspect

    import torch

    kwargs: dict[str, Any] = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                                  attention_mask=torch.ones_like(ids))  # fmt: skip
    if mode == "eager":
        kwargs["disable_compile"] = True
    elif variant == "transformers":
        kwargs["cache_implementation"] = "static"
    # transformers 5.2x names the argument `cache` (`past_key_values` before)
    arg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    make_cache = None
    if variant != "transformers" and (mode == "compiled" or variant == "openkernels-int4"):
        from openkernels.attention import OpenKernelsCache, OpenKernelsStaticCache

        kind = OpenKernelsStaticCache if mode == "compiled" else OpenKernelsCache
        kv_dtype = "int4" if variant == "openkernels-int4" else None
        batch, prompt = ids.shape

        def make_cache() -> Any:
            return kind(model.config, batch_size=batch, max_seqlen=prompt + new, kv_dtype=kv_dtype,
                        device=ids.device)  # fmt: skip

    def run() -> Any:
        with torch.no_grad():
            extra = {} if make_cache is None else {arg: make_cache()}
            return model.generate(ids, **kwargs, **extra)

    return run


def _graphs() -> int:
    """Graphs torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class E2E(_h.Suite):
    """track_ms: milliseconds per step (per generated token for decode); track_tokens_per_s."""

    params = [STEPS, MODES, MODELS]
    param_names = ["step", "mode", "model"]
    version = "e2e-1"
    lean = False

    def applies(self, device_type: str, **params: str) -> bool:
        step, mode, model = params["step"], params["mode"], params["model"]
        if mode == "compiled" and (step != "decode" or device_type != "cuda"):
            return False
        return model != "openkernels-int4" or step == "decode"

    def setup_cache(self) -> dict:
        return self.measure_all()

    def measure(self, dev: Any, params: dict[str, str]) -> dict[str, Any]:
        import torch

        from openkernels.shared.kernelize import kernelize

        step, mode, variant = params["step"], params["mode"], params["model"]
        size = sizes(dev.type)
        model = _script("e2e_kv_decode").build(size.model, dev)
        if step == "train":
            model.train()  # before kernelize, as e2e_models does
        if variant == "openkernels":
            kernelize(model, mode="training" if step == "train" else "inference")
        elif variant == "openkernels-int4":
            kernelize(model, quantize="int4")
        torch.manual_seed(1)
        vocab = size.model["vocab_size"]
        if step == "decode":
            batch, prompt, new = size.decode
            ids = torch.randint(0, vocab, (batch, prompt), device=dev)
            fn, tokens, per_step = _decode(model, ids, new, mode, variant), batch * new, new
        else:
            batch, length = getattr(size, step)
            ids = torch.randint(0, vocab, (batch, length), device=dev)
            fn = (_prefill if step == "prefill" else _train)(model, ids)
            tokens, per_step = batch * length, 1
        try:
            graphs = _graphs()
            warmup, runs = (1, 1) if _h.smoke() else RUNS[step]
            for _ in range(warmup):  # compiles; our kernels' first launches
                fn()
            if mode == "compiled" and _graphs() == graphs:
                raise RuntimeError("generate() compiled no graph: the run would time eager decoding")
            ms = _script("e2e_kv_decode").median_seconds(fn, dev, runs) * 1e3
        finally:
            if mode == "compiled":
                torch._dynamo.reset()  # the compiled graphs hold this model's weights
        return {"ms": ms / per_step, "tokens_per_s": tokens / ms * 1e3}

    def track_tokens_per_s(self, cache: dict, *combo: str) -> float:
        return self.found["tokens_per_s"]

    track_tokens_per_s.unit = "tokens/s"
