"""End-to-end speed of a kernelized model against the unmodified transformers model, in one
process on the same inputs: a Llama-style 1B model (config-built, random bf16 weights).

    python benchmarks/peers/e2e_models.py [--only prefill,decode,train] [--json PATH]

(--only decode-eager: the decode part without its compiled runs.)

prefill: batch 8 x 2048 tokens, forward without cache, logits of the last position (what
    generate() computes), against attn_implementation="sdpa".
decode: batch 1, 32-token prompt, 128 greedy tokens with generate(); ours with int4 weights
    (kernelize(quantize="int4")) and the int4 KV cache (OpenKernelsCache), against the bf16
    sdpa model with its DynamicCache; also ours with bf16 weights, for attribution. The eager
    variants run alternated, one generation each per round (medians of 5 rounds).
train: batch 4 x 2048, forward with labels + backward, mode="training", against sdpa.
Times are CUDA-event medians of several runs after warm-up; outputs are compared too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback

import torch

from openkernels.shared.kernelize import kernelize, unkernelize

LLAMA_1B = dict(  # Llama 3.2 1B's shape
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)


def build(device: str = "cuda") -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_1B, attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model.eval()


def timed(fn, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() over reps runs, CUDA events around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def prefill(model, results: dict) -> None:
    ids = torch.randint(0, LLAMA_1B["vocab_size"], (8, 2048), device="cuda")

    def run():
        with torch.no_grad():
            return model(ids, use_cache=False, logits_to_keep=1).logits

    base_logits = run().float()
    base_ms = timed(run, 5)
    report = kernelize(model)
    ours_logits = run().float()
    ours_ms = timed(run, 5)
    unkernelize(model)
    model.float()  # the float32 model: how far each bf16 run is from it
    exact = run().float()
    model.to(torch.bfloat16)
    results_fp32 = dict(
        sdpa_bf16_vs_fp32=(base_logits - exact).abs().max().item(),
        ours_bf16_vs_fp32=(ours_logits - exact).abs().max().item(),
    )
    err = (ours_logits - base_logits).abs().max().item()
    scale = base_logits.abs().max().item()
    results["prefill"] = dict(
        shape="8x2048", tokens=ids.numel(), sdpa_ms=base_ms, ours_ms=ours_ms,
        sdpa_tok_s=ids.numel() / base_ms * 1e3, ours_tok_s=ids.numel() / ours_ms * 1e3,
        speedup=base_ms / ours_ms, max_abs_logit_diff=err, max_abs_logit=scale,
        same_argmax=float((ours_logits.argmax(-1) == base_logits.argmax(-1)).float().mean()),
        swapped=report.num_swapped, **results_fp32,
    )  # fmt: skip


def train(model, results: dict) -> None:
    ids = torch.randint(0, LLAMA_1B["vocab_size"], (4, 2048), device="cuda")
    model.train()

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss

    base_loss = step().item()
    base_grad = model.model.layers[-1].mlp.gate_proj.weight.grad.float().clone()
    base_ms = timed(step, 5)
    kernelize(model, mode="training")
    ours_loss = step().item()
    ours_grad = model.model.layers[-1].mlp.gate_proj.weight.grad.float()
    ours_ms = timed(step, 5)
    unkernelize(model)
    model.zero_grad(set_to_none=True)
    model.eval()
    rel = ((ours_grad - base_grad).norm() / base_grad.norm()).item()
    results["train"] = dict(
        shape="4x2048", tokens=ids.numel(), sdpa_ms=base_ms, ours_ms=ours_ms,
        sdpa_tok_s=ids.numel() / base_ms * 1e3, ours_tok_s=ids.numel() / ours_ms * 1e3,
        speedup=base_ms / ours_ms, loss_sdpa=base_loss, loss_ours=ours_loss, grad_rel_diff_last_gate_proj=rel,
    )  # fmt: skip


def _cache(model, kv_format, static=False):
    from openkernels.attention import OpenKernelsCache, OpenKernelsStaticCache

    kind = OpenKernelsStaticCache if static else OpenKernelsCache
    return kind(model.config, batch_size=1, max_seqlen=256, kv_dtype=kv_format, device="cuda")


def decode(model, results: dict, new_tokens: int = 128, compiled: bool = True, rounds: int = 5) -> None:
    """Eager generate() for every variant, alternated: three copies of the model (sdpa,
    kernelized, kernelized with int4 weights), two warm-up generations each (the first
    compiles and records every shape it meets), then `rounds` rounds timing one generation of
    each variant in turn, so a slow stretch of the host hits every variant alike. Then, with
    compiled=True, generate()'s own torch.compile + CUDA graphs for static caches
    (transformers compiles the decode step when the cache is compileable): the bf16 sdpa model
    with StaticCache and ours with OpenKernelsStaticCache."""
    import copy

    ids = torch.randint(0, LLAMA_1B["vocab_size"], (1, 32), device="cuda")
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    def generate(m, make_cache=None, **extra):
        with torch.no_grad():
            cache = None if make_cache is None else make_cache()
            return m.generate(ids, past_key_values=cache, **kwargs, **extra)

    entry: dict = dict(prompt=32, new_tokens=new_tokens, rounds=rounds)
    results["decode"] = entry
    ours_bf16, ours_int4 = copy.deepcopy(model), copy.deepcopy(model)
    kernelize(ours_bf16)
    kernelize(ours_int4, quantize="int4")
    variants = {
        "sdpa_eager": (model, None),
        "ours_bf16_eager": (ours_bf16, None),
        "ours_int4w_int4kv_eager": (ours_int4, lambda: _cache(model, "int4")),
        "ours_int4w_bf16kv_eager": (ours_int4, lambda: _cache(model, None)),
    }
    tokens = {label: generate(m, make) for label, (m, make) in variants.items()}
    for m, make in variants.values():
        generate(m, make)
    times: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(rounds):
        for label, (m, make) in variants.items():
            times[label].append(timed(lambda m=m, make=make: generate(m, make), 1, warmup=0))
    for label, ms in times.items():
        median = statistics.median(ms)
        entry[f"{label}_ms_per_token"] = median / new_tokens
        entry[f"{label}_best_ms_per_token"] = min(ms) / new_tokens
        entry[f"{label}_tok_s"] = new_tokens / median * 1e3
        if label != "sdpa_eager":
            entry[f"{label}_same_tokens"] = float((tokens[label] == tokens["sdpa_eager"]).float().mean())
        print(f"  decode {label}: {new_tokens / median * 1e3:.1f} tok/s (median of {rounds}; best "
              f"{new_tokens / min(ms) * 1e3:.1f})", flush=True)  # fmt: skip
    del ours_bf16, ours_int4, variants
    base = tokens["sdpa_eager"]

    def run(label, make_cache=None, **extra):
        out = generate(model, make_cache, **extra)
        ms = timed(lambda: generate(model, make_cache, **extra), 5, warmup=2)
        entry[f"{label}_ms_per_token"] = ms / new_tokens
        entry[f"{label}_tok_s"] = new_tokens / ms * 1e3
        entry[f"{label}_same_tokens"] = float((out == base).float().mean())
        print(f"  decode {label}: {new_tokens / ms * 1e3:.1f} tok/s", flush=True)

    if compiled:
        run("sdpa_static_compiled", cache_implementation="static")
        kernelize(model, quantize="int4")
        run("ours_int4w_int4kv_static_compiled", lambda: _cache(model, "int4", static=True))
        unkernelize(model)
        kernelize(model)
        run("ours_bf16w_bf16kv_static_compiled", lambda: _cache(model, None, static=True))
        unkernelize(model)
    sdpa = entry["sdpa_eager_tok_s"]
    for key in [k for k in entry if k.endswith("_tok_s")]:
        entry[key.replace("_tok_s", "_x_sdpa_eager")] = entry[key] / sdpa


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="prefill,decode,train")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("e2e_models: needs a GPU", file=sys.stderr)
        return 2
    model = build()
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    failed = 0
    for part in args.only.split(","):
        try:
            parts = {"prefill": prefill, "decode": decode, "train": train,
                     "decode-eager": lambda m, r: decode(m, r, compiled=False)}  # fmt: skip
            parts[part](model, results)
        except Exception as error:  # report the other parts anyway
            failed += 1
            results[part] = f"failed: {type(error).__name__}: {error}"
            traceback.print_exc()
            if getattr(model, "_openkernels_kernelize", None) is not None:
                unkernelize(model)
        print(json.dumps({part: results[part.split("-")[0]]}, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
