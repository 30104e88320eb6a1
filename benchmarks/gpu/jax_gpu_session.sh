#!/usr/bin/env bash
# The JAX front ends on the device machine: GPU tests of the "triton" backend, then
# benchmarks/peers/jax_vs_torch.py. Carry .whl/jax (jax-triton's wheel); results in $OUT.
#   bash benchmarks/gpu/jax_gpu_session.sh "activations layernorm" [tests,bench,kernel]
set -uo pipefail
families=${1:-activations layernorm attention quant}
steps=${2:-tests,bench}
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/jax/*.whl || exit 1
export PYTHONPATH=$PWD/shared/src:$(printf '%s:' "$PWD"/packages/*/src)/tmp/site
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c 'import jax, jax_triton, torch, triton; print("jax", jax.__version__, "jax-triton", jax_triton.__version__, "torch", torch.__version__, "triton", triton.__version__, jax.devices())'
if [[ $steps == *tests* ]]; then
  files=()
  for f in $families; do files+=("packages/$f/tests/test_jax.py"); done
  # The xdist workers would each take a share of the GPU for JAX: 4 is enough.
  python3 -m pytest -q -n 4 -p no:cacheprovider shared/tests/test_jax.py "${files[@]}" \
    -k "triton or not (jnp or interpret)" 2>&1 | tee "$out/jax_tests.txt" | grep -E "passed|failed|FAILED|Error" | tail -15
fi
if [[ $steps == *bench* ]]; then
  python3 benchmarks/peers/jax_vs_torch.py $families --json "$out/jax_wall.json" 2>&1 | grep -v Warning | tee "$out/jax_wall.txt"
fi
if [[ $steps == *kernel* ]]; then  # a separate process: the profiler slows later Python launches
  python3 benchmarks/peers/jax_vs_torch.py $families --kernel-time --json "$out/jax_kernel.json" 2>&1 | grep -v Warning | tee "$out/jax_kernel.txt"
fi
