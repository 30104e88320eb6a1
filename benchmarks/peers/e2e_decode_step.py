"""One decode step of a Llama-style 1B model captured in a CUDA graph: int4 weights against
bf16 weights, with Python's generate loop out of the timing (the 4-bit linear issue's
end-to-end bar).

    python benchmarks/peers/e2e_decode_step.py [--context 4096] [--reps 50] [--mode graph|compile|eager]
        [--json PATH] [--tiny --device cpu] [--int4-head] [--tiled] [--layout tiled] [--unfused-append]
        [--unfused-residual] [--prologues]

Variants, each a copy of the same random-weight model:
  sdpa          transformers' own model (attn_implementation="sdpa", bf16 weights) with its
                StaticCache
  ours-bf16     kernelize(model) with OpenKernelsStaticCache (bf16 KV)
  ours-int4     kernelize(model, quantize="int4") with OpenKernelsStaticCache (bf16 KV)
  ours-int4-head  (--int4-head) the same with the lm_head quantized too (quantize's skip=();
                the 1B model ties it to the embedding, which keeps its bf16 weight)
Each cache is filled by a prefill of `context - 1` tokens; the step is a 1-token forward
(batch 1) captured once in a CUDA graph and replayed `reps` times per timing (a cache that
keeps its length on the device appends one token per replay, so the context grows by a few
hundred tokens over the run; one that keeps it on the host rewrites one slot). Reported: milliseconds per step (median of 5
timings of `reps` replays), the ratios, and the largest |logit difference| of each variant's
step against sdpa's relative to sdpa's largest |logit|. A variant whose capture fails is
timed eagerly instead, and says so. --tiny runs a 2-layer model (a smoke test, CPU too,
where every variant is timed eagerly).

--profile: after its timing, each variant's step runs `reps` more times under torch.profiler
and the kernels are listed per step (launches, microseconds, share of the kernel time), with
the kernel time's sum against the step's time: what the weights' bytes cost and what the
rest of the step (small kernels, gaps between launches) does.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback

import torch

from e2e_kv_decode import TINY, build
from e2e_models import LLAMA_1B
from openkernels.quant import use_tiled_codes
from openkernels.shared.kernelize import kernelize


def _caches(model, variant: str, slots: int, device: torch.device):
    if variant == "sdpa":
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=slots)
    from openkernels.attention import OpenKernelsStaticCache

    return OpenKernelsStaticCache(model.config, batch_size=1, max_seqlen=slots, kv_dtype=None, device=device)


def _step_runner(model, cache, context: int, device: torch.device, compiled: bool = False):
    """Prefill context - 1 tokens into `cache`; return the step function (compiled: through
    torch.compile(mode="reduce-overhead", fullgraph=True), as generate() compiles a decode step
    for a static cache: CUDA graphs by cudagraph trees)."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (1, context), generator=gen).to(device)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
    token = ids[:, -1:].clone()
    forward = (
        torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False) if compiled else model
    )

    def step() -> torch.Tensor:
        with torch.no_grad():
            return forward(input_ids=token, past_key_values=cache, use_cache=True).logits

    return step


def _time(fn, reps: int, device: torch.device) -> float:
    """Median milliseconds of one fn() over 5 timings of `reps` calls."""
    times = []
    for _ in range(5):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(times)


def _graphed(step, device: torch.device):
    """(replay function, the graph's logits) or raise when the step cannot be captured."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    first: list[str] = []  # the op that broke the capture (the context's exit reports only that one did)
    try:
        with torch.cuda.graph(graph):
            try:
                logits = step()
            except Exception:
                first.append(traceback.format_exc(limit=-6))
                raise
    except Exception as error:
        raise RuntimeError(first[0] if first else str(error)) from error
    return graph.replay, logits


def _kernel_profile(fn, reps: int, device: torch.device, top: int = 24) -> dict:
    """Per-step kernel launches and device time of `reps` calls of fn, by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    with profile(activities=activities) as prof:
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if device.type == "cuda" and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if device.type != "cuda" and not event.name.startswith("aten::"):
            continue
        entry = kernels.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.device_time if device.type == "cuda" else event.cpu_time
    rows = sorted(((n, c / reps, us / reps) for n, (c, us) in kernels.items()), key=lambda r: -r[2])
    total_us = sum(r[2] for r in rows)
    launches = sum(r[1] for r in rows)
    print(f"    kernels per step: {launches:.0f} launches, {total_us:.1f} us of kernel time", flush=True)
    for name, calls, us in rows[:top]:
        print(
            f"    {us:8.1f} us {100 * us / max(total_us, 1e-9):5.1f}% {calls:5.1f}x  {name[:110]}", flush=True
        )
    return {
        "launches_per_step": launches,
        "kernel_us_per_step": total_us,
        "top": [{"name": n, "launches": c, "us": us} for n, c, us in rows[:top]],
    }


def run(
    shape: dict,
    device: torch.device,
    context: int,
    reps: int,
    mode: str = "graph",
    profile_steps: int = 0,
    skip: tuple[str, ...] = (),
    read_lengths: bool = False,
    int4_head: bool = False,
    tiled: bool = False,
    layout: str = "rows",
) -> dict:
    base = build(shape, device)
    results: dict = {
        "context": context,
        "reps": reps,
        "device": str(device),
        "mode": mode,
        "skip": list(skip),
        "layout": layout,
    }
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    logits: dict[str, torch.Tensor] = {}
    variants = ("sdpa", "ours-bf16", "ours-int4", *(("ours-int4-head",) if int4_head else ()))
    for variant in variants:
        model = copy.deepcopy(base)
        if variant == "ours-bf16":
            kernelize(model, skip=skip)
        elif variant == "ours-int4":
            kernelize(model, quantize={"kind": "int4", "layout": layout}, skip=skip)
        elif variant == "ours-int4-head":
            kernelize(model, quantize={"kind": "int4", "skip": (), "layout": layout}, skip=skip)
        if tiled and variant.startswith("ours-int4"):
            results.setdefault("tiled_layers", {})[variant] = use_tiled_codes(model)
        # Room for every step timed: a cache that counts its length on the device moves one
        # slot per replay (the context grows by at most ~6 * reps + 8 tokens).
        cache = _caches(model, variant, context + 8 * reps + 64, device)
        if read_lengths and variant != "sdpa":  # A/B: the eager read per layer of attention < 0.8.5
            for layer in cache.layers:
                layer._host_counts, layer._host_length = False, None
        step = _step_runner(model, cache, context, device, compiled=mode == "compile")
        logits[variant] = step().float().clone()  # the first step, at position context - 1
        how, fn = "eager" if mode != "compile" else "torch.compile reduce-overhead", step
        if mode == "compile":
            for _ in range(3):  # cudagraph trees record on the first calls
                step()
        elif device.type == "cuda" and mode == "graph":
            try:
                fn = _graphed(step, device)[0]
                fn()
                how = "cuda graph"
            except Exception as error:  # timed eagerly instead, and reported
                how = f"eager (capture failed: {str(error)[-1500:]})"
                torch.cuda.synchronize(device)
                fn = step
        ms = _time(fn, reps, device)
        results[variant] = {"ms_per_step": ms, "timed": how}
        print(f"  {variant}: {ms:.3f} ms per step ({how})", flush=True)
        if profile_steps:
            results[variant]["profile"] = _kernel_profile(fn, profile_steps, device)
        del model, step, fn, cache
    ref = logits["sdpa"]
    for variant in variants[1:]:
        results[variant]["max_logit_diff_vs_sdpa"] = float(
            (logits[variant] - ref).abs().max() / ref.abs().max()
        )
    bf16, int4 = results["ours-bf16"]["ms_per_step"], results["ours-int4"]["ms_per_step"]
    results["int4_x_ours_bf16"] = bf16 / int4
    results["int4_x_sdpa"] = results["sdpa"]["ms_per_step"] / int4
    results["ours_bf16_x_sdpa"] = results["sdpa"]["ms_per_step"] / bf16
    print(f"  int4 weights: {results['int4_x_ours_bf16']:.2f}x ours bf16, {results['int4_x_sdpa']:.2f}x sdpa; "
          f"ours bf16 {results['ours_bf16_x_sdpa']:.2f}x sdpa", flush=True)  # fmt: skip
    if int4_head:
        results["int4_head_x_ours_bf16"] = bf16 / results["ours-int4-head"]["ms_per_step"]
        print(f"  int4 weights and lm_head: {results['int4_head_x_ours_bf16']:.2f}x ours bf16", flush=True)
    for variant in variants[1:]:
        # The checksum tells two runs' first steps apart bit for bit (an A/B of launch options).
        results[variant]["first_step_logit_sum"] = float(logits[variant].double().sum())
        print(f"  {variant}: max |logit - sdpa's| / max |sdpa logit| = "
              f"{results[variant]['max_logit_diff_vs_sdpa']:.3g}; first step's logit sum "
              f"{results[variant]['first_step_logit_sum']!r}", flush=True)  # fmt: skip
    return results


def parse_tc_routes(spec: str) -> dict[tuple[int, int], str]:
    """--tc-routes as {(N, K): config}."""
    if spec.startswith("from:"):
        with open(spec.removeprefix("from:")) as f:
            rows = json.load(f)
        best: dict[tuple[int, int], tuple[float, str]] = {}
        for row in rows:
            int4 = row.get("kind", "int4") == "int4"  # quant_tc_gemv.py --kinds may add NF4's rows
            if int4 and row["m"] == 1 and row["us"] is not None and str(row["name"]).startswith("tc"):
                key = (row["n"], row["k"])
                best[key] = min(best.get(key, (float("inf"), "")), (row["us"], row["name"]))
        return {key: name for key, (_, name) in best.items()}
    routes = {}
    for item in filter(None, spec.split(",")):
        shape, config = item.split("=")
        n, k = (int(v) for v in shape.split("x"))
        routes[(n, k)] = config
    return routes


def route_tc(routes: dict[tuple[int, int], str]) -> None:
    """Send int4 calls of up to 8 rows with these weight shapes to the given tensor-core GEMV
    configs (quant.cuda.default_tc wrapped for this process)."""
    from openkernels.quant import cuda as quant_cuda

    default = quant_cuda.default_tc

    def routed(m: int, n: int, k: int, group_size: int, arch: str) -> str | None:
        config = routes.get((n, k))
        return config if config is not None and m <= 8 else default(m, n, k, group_size, arch)

    quant_cuda.default_tc = routed
    print(f"  tc routes: {', '.join(f'{n}x{k}={c}' for (n, k), c in sorted(routes.items()))}", flush=True)


def route_tc_pdl() -> None:
    """Every call default_tc sends to a tensor-core GEMV config goes to its "-p" variant (a
    programmatic dependent launch, its weights fetched into L2 while the kernel before it runs)."""
    from openkernels.quant import cuda as quant_cuda

    default = quant_cuda.default_tc

    def routed(m: int, n: int, k: int, group_size: int, arch: str) -> str | None:
        config = default(m, n, k, group_size, arch)
        return None if config is None else f"{config}-p"

    quant_cuda.default_tc = routed
    print("  tc routes: default_tc's configs as programmatic dependents (-p)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    parser.add_argument("--mode", choices=("graph", "compile", "eager"), default="graph",
                        help="graph: capture the eager step in a CUDA graph (eager where that fails); compile: "
                        "torch.compile(mode='reduce-overhead') as generate() does for static caches; eager: the "
                        "Python step itself, host path included")  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="list each variant's kernels per step over STEPS profiled steps")  # fmt: skip
    parser.add_argument("--skip", default="", help="comma-separated module names / globs kernelize leaves "
                        "(model.layers.?,model.layers.?? : the decoder layers' add + norm fusion off)")  # fmt: skip
    parser.add_argument("--int4-head", action="store_true",
                        help="also time int4 weights with the lm_head quantized (variant ours-int4-head)")  # fmt: skip
    parser.add_argument(
        "--tiled",
        action="store_true",
        help="the int4 variants keep tiled codes too (quant's use_tiled_codes, quant 0.10.7)",
    )
    parser.add_argument("--layout", choices=("rows", "tiled"), default="rows",
                        help="how the int4 variants store their codes (Int4Linear's layout, quant 0.10.15)")  # fmt: skip
    parser.add_argument("--read-lengths", action="store_true",
                        help="A/B: the static cache's layers read their lengths from the device in eager calls")  # fmt: skip
    parser.add_argument("--tc-routes", default="",
                        help="A/B: the int4 layers' tensor-core GEMV config per weight shape instead of quant's "
                        "default_tc: 'NxK=config,...', 'from:PATH' for the fastest tc config per shape at M = 1 in "
                        "benchmarks/studies/quant_tc_gemv.py --json PATH, or 'pdl' for default_tc's own configs "
                        "launched as programmatic dependents (their '-p' variants)")  # fmt: skip
    parser.add_argument("--unfused-append", action="store_true",
                        help="A/B: kernelize's attention rotates q and k before the static cache, which then "
                        "appends and attends in two launches and advances its length in a third (as before "
                        "attention 0.8.13's fused append)")  # fmt: skip
    parser.add_argument("--unfused-residual", action="store_true",
                        help="A/B: the decoder layers add the MLP's residual after the MLP instead of in a "
                        "4-bit down_proj's kernel (as before quant 0.10.16's Int4Linear.forward_add)")  # fmt: skip
    parser.add_argument("--prologues", action="store_true",
                        help="A/B: the 4-bit GEMVs' prologue builds take the decoder's norms and the gated "
                        "activation (quant 0.10.17's forward_normed / forward_gated; off by default: "
                        "quant.cuda.PROLOGUES_DEFAULT)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.prologues:
        from openkernels.quant import cuda as quant_cuda

        quant_cuda.PROLOGUES_DEFAULT = True
    if args.unfused_residual:
        from openkernels.activations import kernelize as activations_kernelize

        activations_kernelize._gated_forward.adds_residual = False
    if args.unfused_append:
        from openkernels.attention import kernelize as attention_kernelize

        attention_kernelize._rotates_in_attention = lambda module, cache: False
    if args.tc_routes == "pdl":
        route_tc_pdl()
    elif args.tc_routes:
        route_tc(parse_tc_routes(args.tc_routes))
    shape = TINY if args.tiny else LLAMA_1B
    skip = tuple(s for s in args.skip.split(",") if s)
    results = run(
        shape,
        torch.device(args.device),
        args.context,
        args.reps,
        args.mode,
        args.profile,
        skip,
        args.read_lengths,
        args.int4_head,
        args.tiled,
        args.layout,
    )
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
