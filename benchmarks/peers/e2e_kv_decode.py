"""End-to-end decode of a Llama-style 1B model with every KV-cache format, against transformers'
SDPA with its own static cache, both compiled the same way (the quantized-KV issue's bar).

    python benchmarks/peers/e2e_kv_decode.py [--batches 1,16] [--prompt 4096] [--new 256]
        [--formats bf16,fp8,int8,int4] [--models plain,bf16,int4,int4-head] [--json PATH]
        [--eager] [--tiny --device cpu]

Contenders, each through `model.generate()` with greedy decoding on one random prompt batch:
  sdpa          attn_implementation="sdpa", cache_implementation="static" (transformers'
                StaticCache)
  ours-<fmt>    attn_implementation="openkernels" with OpenKernelsStaticCache(kv_dtype=fmt)
                (bf16: the model's dtype stored as is; fp8 at scale 1.0; int8 / int4 with one
                scale per token and head)
generate() compiles the decode step of a compileable cache by itself on CUDA (torch.compile
with CUDA graphs, transformers' default compile config), so both sides are compiled the same
way; --eager turns that off for both. The model's linear layers, norms and MLPs stay
transformers' own: only attention and the cache differ. --models adds kernelized copies of
the model (`kernelize(model)`: "bf16"; with int4 weights: "int4", the lm_head too: "int4-head")
whose ours-<fmt> rows run after the plain model's: issue 24's generate() report (int4 weights
against bf16 weights, both kernelized, through a compiled generate()) is
`--models bf16,int4 --formats bf16 --batches 1`. sdpa runs on the plain model only.

Per contender: decode tok/s (sequences x new tokens over the time of generate(new) minus
that of generate(1), the prefill and the first token), and agreement with sdpa's output: the
largest |logit difference| of the first generated token relative to sdpa's largest |logit|
(same inputs, no earlier divergence), and the fraction of generated tokens equal to sdpa's up
to the first one that differs (random weights give near-flat logits, so greedy paths part
early even between two correct implementations: read the logit column first).
--tiny runs a 2-layer model on small shapes (a smoke test of the script, on the CPU too).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import statistics
import sys
import time

import torch

from e2e_models import LLAMA_1B  # Llama 3.2 1B's shape, as the other end-to-end benchmark

TINY = dict(LLAMA_1B, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32)  # fmt: skip
FORMATS = {"bf16": None, "fp8": "fp8", "int8": "int8", "int4": "int4"}
# --models: how the model is changed before its ours-<fmt> rows (kernelize's arguments).
MODELS = {"plain": None, "bf16": {}, "int4": {"quantize": "int4"},
          "int4-head": {"quantize": {"kind": "int4", "skip": ()}}}  # fmt: skip


def build(shape: dict, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # An initializer range of 0.05: attention scores of order 1 (0.02 leaves them near uniform).
    config = LlamaConfig(**shape, torch_dtype=torch.bfloat16, initializer_range=0.05, pad_token_id=0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model.eval()


def kernelized(model, kwargs: dict):
    """A copy of `model` through openkernels.kernelize(copy, **kwargs)."""
    from openkernels.shared.kernelize import kernelize

    copy_ = copy.deepcopy(model)
    kernelize(copy_, **kwargs)
    return copy_.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate(model, ids, new: int, cache, eager: bool, **extra):
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids), return_dict_in_generate=True, output_logits=True)  # fmt: skip
    if eager:
        kwargs["disable_compile"] = True
    if cache is not None:  # transformers 5.2x names it `cache` (`past_key_values` before)
        kwargs[
            "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        ] = cache
    with torch.no_grad():
        return model.generate(ids, **kwargs, **extra)


def median_seconds(fn, device: torch.device, reps: int) -> float:
    """Median wall seconds of `reps` calls, the device waited for around each (the asv e2e
    suite times its steps with this too)."""
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(model, batch: int, prompt: int, new: int, formats: list[str], eager: bool, device: torch.device,
        reps: int, models: dict | None = None, plain_formats: list[str] | None = None) -> list[dict]:  # fmt: skip
    """The sdpa row and each format's row on `model` (`plain_formats` where given), then each
    format's rows on every model of `models` (name -> a kernelized copy), all compared with the
    sdpa row."""
    from openkernels.attention import OpenKernelsStaticCache, register_with_transformers

    register_with_transformers()
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=g).to(device)
    contenders: dict[str, tuple[str, object, object]] = {"sdpa": ("sdpa", None, model)}
    runners = {"": (model, formats if plain_formats is None else plain_formats)}
    runners.update({f" [{name}]": (m, formats) for name, m in (models or {}).items()})
    for label, (runner, runner_formats) in runners.items():
        for fmt in runner_formats:
            contenders[f"ours-{fmt}{label}"] = ("openkernels", FORMATS[fmt], runner)
    rows, ref = [], None
    for name, (attn, kv_dtype, model) in contenders.items():
        model.set_attn_implementation(attn)
        # Each contender compiles afresh: one cache format after another recompiles the same
        # decode step, and past dynamo's recompile limit (8) the rest ran in eager mode.
        torch._dynamo.reset()

        # One cache per contender, emptied before each call (as transformers keeps and resets its
        # own static cache between generate() calls): a new cache per call gives the compiled
        # step new static addresses, and CUDA graphs are recorded again in every call.
        cache = None if attn == "sdpa" else OpenKernelsStaticCache(
            model.config, batch, prompt + new, kv_dtype=kv_dtype, device=device
        )  # fmt: skip

        def call(n: int, attn=attn, model=model, cache=cache):
            if cache is None:
                return _generate(model, ids, n, None, eager, cache_implementation="static")
            cache.reset()
            return _generate(model, ids, n, cache, eager)

        out = call(new)  # warm-up: compiles, captures the graphs
        call(1)
        total = median_seconds(lambda: call(new), device, reps)
        first = median_seconds(lambda: call(1), device, reps)
        decode_s = max(total - first, 1e-9)
        tokens = out.sequences[:, prompt:]
        logits0 = out.logits[0].float()
        row = dict(contender=name, batch=batch, prompt=prompt, new_tokens=new, compiled=not eager,
                   decode_tok_s=batch * (new - 1) / decode_s, generate_s=total, prefill_and_first_s=first)  # fmt: skip
        if ref is None:
            ref = (tokens, logits0)
        else:
            same = (tokens == ref[0]).int().cumprod(dim=1)  # 1 until the first difference
            row["same_tokens_until_divergence"] = float(same.float().mean())
            row["first_token_logit_err"] = float((logits0 - ref[1]).abs().max() / ref[1].abs().max())
        rows.append(row)
        print(_line(row, rows[0]), flush=True)
    return rows


def _line(row: dict, base: dict) -> str:
    text = (f"B{row['batch']} prompt {row['prompt']} +{row['new_tokens']}  {row['contender']:<22} "
            f"{row['decode_tok_s']:10.1f} tok/s  {row['decode_tok_s'] / base['decode_tok_s']:5.2f}x sdpa")  # fmt: skip
    if "first_token_logit_err" in row:
        text += (f"  logit err {row['first_token_logit_err']:.2e}  same tokens "
                 f"{row['same_tokens_until_divergence']:.2f}")  # fmt: skip
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--models", default="plain", help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--eager", action="store_true", help="no compile on either side")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        parser.error(f"formats are {list(FORMATS)}, got {unknown}")
    names = [m for m in args.models.split(",") if m]
    if sorted(set(names) - set(MODELS)) or not names:
        parser.error(f"models are {list(MODELS)}, got {names}")
    device = torch.device(args.device)
    model = build(TINY if args.tiny else LLAMA_1B, device)
    models = {name: kernelized(model, MODELS[name]) for name in names if name != "plain"}
    # sdpa's row runs on the plain model whatever --models says: the others are compared with it.
    formats_plain = formats if "plain" in names else []
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        results += run(model, batch, args.prompt, args.new, formats, args.eager or device.type != "cuda", device,
                       args.reps, models, plain_formats=formats_plain)  # fmt: skip
    if args.json:
        meta = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
