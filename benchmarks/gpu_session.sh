#!/usr/bin/env bash
# One device-machine session: GPU tests, config sweep and the peer benchmark of a family.
#   bash benchmarks/gpu_session.sh [family] [steps: tests,tune,bench]
# Carry .whl (peer wheels from ../shared/tools/peer-wheels) with the call; results in $OUT.
set -uo pipefail
family=${1:-activations}
steps=${2:-tests,overhead,bench,dtypes,demo}
out=${OUT:-/tmp/out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD/shared/src:$(printf '%s:' "$PWD"/packages/*/src)/tmp/site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
if [[ $steps == *tests* ]]; then
  OPENKERNELS_STRICT=1 python3 -m pytest -p openkernels.shared.testing.plugin -q -x \
    "packages/$family/tests" -m "not interpreter and not aot" -k "cuda or offsets" 2>&1 | tee "$out/tests.txt" | tail -5
fi
if [[ $steps == *tune* && -f benchmarks/tune_$family.py ]]; then
  python3 "benchmarks/tune_$family.py" 2>&1 | tee "$out/tune.txt" | sort -t'(' -k2 -r | head -12
fi
if [[ $steps == *overhead* && -f benchmarks/overhead.py ]]; then
  python3 benchmarks/overhead.py 2>&1 | tee "$out/overhead.txt"
fi
if [[ $steps == *bench* ]]; then
  python3 benchmarks/run.py "$family" --json "$out/bench_bf16.json" 2>&1 | grep -v '^W1130' | tee "$out/bench_bf16.txt"
fi
if [[ $steps == *dtypes* ]]; then
  python3 benchmarks/run.py "$family" --dtype float16,float32 --ops silu_and_mul,gelu_and_mul \
    --json "$out/bench_f16_f32.json" 2>&1 | grep -v '^W1130' | tee "$out/bench_f16_f32.txt"
fi
if [[ $steps == *demo* ]]; then
  python3 -m openkernels.shared.demo --quick 2>&1 | grep -v '^W1130' | tee "$out/demo.txt" | grep -E "FAIL|checks|passed"
fi
