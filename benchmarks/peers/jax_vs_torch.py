"""Each family's JAX ops against the same kernels called from PyTorch, and against XLA's
fusion of the jax.numpy composition, on a GPU (see openkernels.shared.dev.bench_jax).

    python benchmarks/peers/jax_vs_torch.py [family ...] [--quick] [--kernel-time] [--json PATH]

The issue's bar: JAX under jax.jit within 5% of the PyTorch call (jax/torch <= 1.05) and
faster than the jnp composition (jnp/jax > 1). Needs a GPU build of JAX and jax-triton.
"""

from __future__ import annotations

import argparse
import json
import sys

FAMILIES = ("activations", "layernorm", "attention", "quant")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--quick", action="store_true", help="the first shape of each family only")
    parser.add_argument("--only", default="", help="cases whose label contains this text")
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--batch", type=int, default=50, help="calls per timed batch")
    parser.add_argument("--kernel-time", action="store_true", help="device time in kernels (torch.profiler)")
    args = parser.parse_args(argv)

    from openkernels.shared.dev.bench_jax import run_jax_cases

    results = []
    for family in args.families:
        from openkernels.shared import manifest

        modules = manifest.families()[family].bench_modules()
        cases = [c for m in modules if hasattr(m, "jax_cases") for c in m.jax_cases()]
        cases = [c for c in cases if args.only in c.label]
        if args.quick and cases:
            first = cases[0].shape
            cases = [c for c in cases if c.shape == first]
        print(f"# {family}: {len(cases)} cases", flush=True)
        results += run_jax_cases(
            cases, batch=args.batch, kernel_time=args.kernel_time, log=lambda s: print(s, flush=True)
        )
    if not results:
        print("# no case selected")
        return 1
    worst = max(results, key=lambda m: m.jax_over_torch)
    print(f"# worst jax/torch: {worst.jax_over_torch:.3f} ({worst.label})")
    slower = [m.label for m in results if m.jnp_over_jax <= 1.0]
    print(f"# cases where the jnp composition is as fast or faster: {slower or 'none'}")
    if args.json:
        rows = [
            {**vars(m), "jax_over_torch": m.jax_over_torch, "jnp_over_jax": m.jnp_over_jax} for m in results
        ]
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
