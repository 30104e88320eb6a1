#!/usr/bin/env bash
# One device-machine session: GPU tests, config sweep and the peer benchmark of a family.
#   bash benchmarks/gpu/gpu_session.sh [family] [steps: tests,fusedappend,cluster,push,sparams,wload,bwdgrid,ncu,gemv,tc,pdl,bars,xsplit,lookup,layout,mconfigs,genreport,largem,route,persist,alibi,combine,kvshort,dropout,gluon,nf4,wgmma,wall,backward,bwdsweep,split,check,tune,hosttime,bench,long,dtypes,demo,decode,replay]
# decode (attention): KV-cache decode of every format at the shapes and one short
# sequence (B1 S4096) beside SDPA, kernel and wall time, then the end-to-end decode benchmark.
# Carry .whl (peer wheels from ../shared/tools/peer-wheels, pytest-xdist) with the call;
# the studies' time limits can be lowered to fit several families in one call
# (GLUON_TESTS_S, GLUON_STUDY_S, NF4_S, WGMMA_TESTS_S, WGMMA_STUDY_S, WALL_S, BACKWARD_S,
# BWDSWEEP_S, SPLIT_S, TC_S, E2E_S, NCU_S, PUSH_S, in seconds; NCU_SHAPES, NCU_VARIANTS, NCU_OP,
# PUSH_SHAPES; E2E_PROFILE=steps lists the decode step's kernels per variant, E2E_AB=1 runs it
# again without the decoder layers' add + norm fusion, TC_WALL=0 skips the tc tests and wall times,
# E2E_MODES=graph,compile times the fusedappend step's decode both ways);
# WLOAD_VARIANTS, WLOAD_SHAPES, WLOAD_S; SPARAMS_RUN, SPARAMS_SHAPES, SPARAMS_S, SPARAMS_TESTS_S,
# SPARAMS_TEST_VARIANTS;
# results in $OUT.
set -uo pipefail
family=${1:-activations}
steps=${2:-tests,hosttime,bench,dtypes,demo}
out=${OUT:-/tmp/out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD/shared/src:$(printf '%s:' "$PWD"/packages/*/src)/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
run() { python3 "$@" 2>&1 | grep -v '^W1130'; }
if [[ $steps == *tests* ]]; then
  # Triton compiles one kernel per option combination: spread them over the CPU cores.
  # The JAX tests run apart (benchmarks/gpu/jax_gpu_session.sh): each xdist worker that imports
  # JAX takes 75% of the GPU's memory by default, and 12 of them aborted the quant run.
  xdist=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 8")
  XLA_PYTHON_CLIENT_PREALLOCATE=false OPENKERNELS_STRICT=1 python3 -m pytest \
    -q -rfE $xdist "packages/$family/tests" --ignore "packages/$family/tests/test_jax.py" \
    -m "not interpreter and not aot" -k "cuda or offsets or 2_to_the_31" \
    2>&1 | tee "$out/tests.txt" | tail -8
fi
E2E_MODES=${E2E_MODES:-graph}
if [[ $steps == *fusedappend* && $family == attention ]]; then
  # The static cache's one-op decode step (attention 0.8.13): its GPU tests (the append inside
  # the attention kernel, per-token rotary, the length advanced by the combine), the static
  # cache's transformers tests, then the 1B decode step with the fusion and without it.
  # The MLP's residual in a 4-bit down_proj's bias (quant 0.10.16) is A/B'd with it.
  OPENKERNELS_STRICT=1 timeout ${FUSED_TESTS_S:-300} python3 -m pytest -q -rfE \
    packages/attention/tests/test_kvcache_fused_append.py packages/attention/tests/test_hf_cache.py \
    packages/quant/tests/test_api.py -m "not interpreter and not aot" \
    -k "cuda or static or kernelized or forward_add" 2>&1 | tee "$out/fused_tests.txt" | tail -6
  # E2E_MODES=graph,compile also times the step as generate() compiles it (the op in the graph).
  for mode in ${E2E_MODES//,/ }; do
    for ab in "" "--unfused-append --unfused-residual"; do
      timeout ${E2E_S:-200} python3 benchmarks/peers/e2e_decode_step.py --context 4096 --reps 50 --mode $mode \
        --int4-head $ab --profile ${E2E_PROFILE:-0} --json "$out/e2e_fused_$mode${ab:+_unfused}.json" 2>&1 \
        | grep -v '^ *[{}"]\|^ *\]\|Warning\|forward_call' | tail -${E2E_TAIL:-12}
    done
  done
fi
if [[ $steps == *gated* && $family == quant ]]; then
  # The gated down projection and the normed q/k/v and gate/up projections (quant 0.10.17): the
  # activation and the decoder's norms in the tensor-core GEMV's prologue. Their GPU tests, the
  # fused KV op at 128K tokens (owed since attention 0.8.13), their kernel time against the two
  # launches they replace, then the 1B decode step without them (the default) and with them
  # (--prologues), CUDA graph and E2E_MODES.
  OPENKERNELS_STRICT=1 timeout ${GATED_TESTS_S:-240} python3 -m pytest -q -rfE packages/quant/tests/test_gated.py \
    packages/quant/tests/test_normed.py packages/attention/tests/test_kvcache_fused_append.py \
    -m "not interpreter and not aot" -k "gpu or 128k" 2>&1 | tee "$out/gated_tests.txt" | tail -6
  timeout ${FUSED_GEMV_S:-120} python3 benchmarks/studies/quant_fused_gemv.py --ms 1,4 --json "$out/fused_gemv.json" 2>&1 \
    | tail -8
  for mode in ${E2E_MODES//,/ }; do
    for ab in "" "--prologues"; do
      timeout ${E2E_S:-200} python3 benchmarks/peers/e2e_decode_step.py --context 4096 --reps 50 --mode $mode \
        --int4-head $ab --profile ${E2E_PROFILE:-0} --json "$out/e2e_gated_$mode${ab:+_prologues}.json" 2>&1 \
        | grep -v '^ *[{}"]\|^ *\]\|Warning\|forward_call' | tail -${E2E_TAIL:-12}
    done
  done
fi
if [[ $steps == *cluster* && $family == layernorm ]]; then
  # The sm_90 cluster kernels (CUDA C++, forced only) under time limits: a kernel that hung
  # would otherwise take the whole call. Their own tests first, then the correctness suite's
  # cuda-cluster target, then the split counters' and long-row replay checks.
  timeout 300 python3 -m pytest -q -rfE packages/layernorm/tests/test_cluster.py -m "not aot" -x 2>&1 \
    | tee "$out/cluster_tests.txt" | tail -8
  timeout 600 python3 -m pytest -q -rfE packages/layernorm/tests/test_correctness.py -k "cuda-cluster" -x 2>&1 \
    | tee "$out/cluster_correctness.txt" | tail -8
  timeout 300 python3 -m pytest -q -rfE packages/layernorm/tests -k "counters_at_zero or long_rows_replay" 2>&1 \
    | tee "$out/split_counters.txt" | tail -8
fi
if [[ $steps == *push* && $family == layernorm ]]; then
  # The pushed forward (norm_push.cu, the sm_90 default for long rows since layernorm 0.11.0):
  # its GPU tests and the long-row replay, the kernel-level variants against Triton and QuACK
  # (its other builds push-plain / -trim / -bulk / -lean included: cuda.PUSH_VARIANTS; source
  # .whl-cute-b/install.sh first for QuACK), then the public op's wall and kernel time.
  # PUSH_TESTS=0 skips the tests; PUSH_RUN names the study's variants (push( : the default build
  # alone, push : every build of cuda.PUSH_VARIANTS too), PUSH_BWD its backward shapes (none).
  if [[ ${PUSH_TESTS:-1} == 1 ]]; then
    timeout 240 python3 -m pytest -q -rfE packages/layernorm/tests/test_cluster.py packages/layernorm/tests/test_replay.py \
      -k "cuda or long_rows or replay or push" -m "not aot and not interpreter" 2>&1 | tee "$out/push_tests.txt" | tail -4
  fi
  NORM_VARIANTS=${PUSH_RUN:-"triton,push(,quack"} timeout ${PUSH_S:-200} python3 benchmarks/studies/norm_cluster_variants.py \
    ${PUSH_SHAPES:-4096x16384,2048x32768,1024x65536,512x131072,256x262144,128x524288} rms,ln,addrms ${PUSH_BWD:-8x4096} 2>&1 \
    | tee "$out/push_variants.txt" | grep -v "^bwd\|^fwd+bwd" | tail -16
  timeout ${PUSH_S:-200} python3 benchmarks/peers/run.py layernorm --shapes ${PUSH_SHAPES:-4096x16384,2048x32768,1024x65536,512x131072,256x262144,128x524288} \
    --directions fwd --peers torch,quack --kernel-time --json "$out/push_public.json" 2>&1 | tail -40
fi
if [[ $steps == *sparams* && $family == layernorm ]]; then
  # The weight and bias staged in shared memory (layernorm 0.11.12's study builds sp / sp2,
  # cuda.PUSH_VARIANTS) and LayerNorm's centring as one FMA (cf; spf: both), kernel level beside
  # the default and Triton (QuACK where installed: source .whl-cute-b/install.sh first), then the
  # GPU tests of the pushed forward on each build of SPARAMS_TEST_VARIANTS.
  python3 -c "from concurrent.futures import ThreadPoolExecutor as P; from openkernels.layernorm import cuda as C
with P(5) as p: list(p.map(lambda v: C.push_variant_library(v)(), ['w3r', 'sp', 'sp2', 'cf', 'spf']))"
  NORM_VARIANTS=${SPARAMS_RUN:-"triton,push(,push-sp(,push-sp2(,push-cf(,push-spf(,quack"} timeout ${SPARAMS_S:-240} \
    python3 benchmarks/studies/norm_cluster_variants.py ${SPARAMS_SHAPES:-4096x16384,2048x32768,1024x65536,512x131072,256x262144} \
    rms,ln none 2>&1 | tee "$out/sparams_variants.txt" | tail -12
  for variant in ${SPARAMS_TEST_VARIANTS:-sp2 spf}; do
    PUSH_VARIANT_UNDER_TEST=$variant PYTHONPATH=$PWD/benchmarks/gpu:$PYTHONPATH timeout ${SPARAMS_TESTS_S:-200} python3 \
      -m pytest -q -rfE -p push_variant_plugin packages/layernorm/tests/test_cluster.py -k "(cuda and push) or pushed_on" \
      -m "not aot and not interpreter" 2>&1 | tee "$out/sparams_tests_$variant.txt" | tail -4
  done
fi
if [[ $steps == *wload* && $family == layernorm ]]; then
  # Where the pushed forward's weight and bias loads are issued (layernorm 0.11.11 study:
  # cuda.PUSH_VARIANTS g2, g4, w2, w3, pf, w2r, w3r beside the default build), kernel level,
  # QuACK in the same process (source .whl-cute-b/install.sh first), forward only.
  NORM_VARIANTS=${WLOAD_VARIANTS:-"triton,push(,push-g2,push-g4,push-w2,push-w3,push-pf,push-w2r,push-w3r,quack"} \
    timeout ${WLOAD_S:-360} python3 benchmarks/studies/norm_cluster_variants.py \
    ${WLOAD_SHAPES:-4096x16384,2048x32768,1024x65536,512x131072,256x262144} rms,ln,addrms none 2>&1 \
    | tee "$out/wload_variants.txt" | tail -20
fi
if [[ $steps == *bwdgrid* && $family == layernorm ]]; then
  # The tile backward's grid sized to fit an SM (layernorm 0.11.5): candidate tiles beside
  # 0.11.4's, then forward+backward through autograd against Liger and QuACK (source
  # .whl-cute-b/install.sh first for QuACK), then the GPU correctness suite's CUDA cases.
  timeout ${BWDGRID_S:-200} python3 benchmarks/studies/norm_bwd_occupancy.py 2048,4096,8192 2>&1 \
    | tee "$out/bwd_grid.txt" | grep "|"
  timeout ${BWDGRID_S:-200} python3 benchmarks/peers/run.py layernorm --ops rms_norm,layer_norm,add_rms_norm \
    --shapes 32768x2048,16384x4096,8192x8192,4096x16384 --directions fwd+bwd --peers liger,quack --kernel-time \
    2>&1 | tee "$out/bwd_grid_public.txt" | grep -v copy | tail -40
  timeout ${BWDGRID_TESTS_S:-400} python3 -m pytest -q -rfE packages/layernorm/tests/test_correctness.py \
    -m "not interpreter and not aot" -k "cuda and not cluster" -x 2>&1 | tee "$out/bwd_grid_tests.txt" | tail -3
fi
if [[ $steps == *ncu* && $family == layernorm ]]; then
  # Nsight Compute's counters for one long-row forward call per variant (benchmarks/studies/
  # norm_ncu_target.py): a copy of the same bytes, the Triton launchers, the pushed kernel and
  # its lean study build, QuACK where it imports. Full reports in $out/ncu_norm.txt.
  for shape in ${NCU_SHAPES:-1024x65536}; do
    for v in ${NCU_VARIANTS:-copy triton push push-plain quack}; do
      timeout ${NCU_S:-120} ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section SchedulerStats python3 benchmarks/studies/norm_ncu_target.py "$v" "$shape" ${NCU_OP:-rms} 2>&1 \
        | tee -a "$out/ncu_norm.txt" \
        | grep -E "profiled|Error|  [a-z_]*(kernel|Kernel|copy)|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Dynamic Shared|Cluster|Warp Cycles Per Issued|Issued Warp|No Eligible" | head -40
    done
  done
fi
if [[ $steps == *gemv* && $family == quant ]]; then
  # The CUDA C++ batch-1 GEMV (forced only) under time limits: its tests, then the
  # correctness suite's cuda-gemv target.
  timeout 300 python3 -m pytest -q -rfE packages/quant/tests/test_gemv.py -m "not aot" -x 2>&1 \
    | tee "$out/gemv_tests.txt" | tail -8
  timeout 600 python3 -m pytest -q -rfE packages/quant/tests/test_correctness.py -k "cuda-gemv" -x 2>&1 \
    | tee "$out/gemv_correctness.txt" | tail -8
fi
if [[ $steps == *gluon* && $family == attention ]]; then
  # The Gluon Hopper kernels (forced only) under time limits: a warp-specialized kernel whose
  # barriers never complete hangs instead of failing. Forward tests, then the rest (a hung
  # backward must not hide a working forward); the study only if the forward passed.
  gluon_tests=packages/attention/tests/test_gluon.py
  timeout ${GLUON_TESTS_S:-150} python3 -m pytest -q -rfE $gluon_tests -k "(forced_calls or not backward) and not entries" -x 2>&1 \
    | tee "$out/gluon_fwd_tests.txt" | tail -8
  timeout ${GLUON_TESTS_S:-150} python3 -m pytest -q -rfE $gluon_tests -k "(backward and not forced_calls) or entries" -x 2>&1 \
    | tee "$out/gluon_bwd_tests.txt" | tail -8
  if grep -q " passed" "$out/gluon_fwd_tests.txt" && ! grep -qE "failed|error" "$out/gluon_fwd_tests.txt"; then
    timeout ${GLUON_STUDY_S:-260} python3 benchmarks/studies/attention_gluon.py 2>&1 | tee "$out/gluon_study.txt" | tail -40
  fi
fi
if [[ $steps == *nf4* && $family == quant ]]; then
  # NF4 levels by warp shuffle in the Triton kernels against the gather (checks, then times).
  timeout ${NF4_S:-300} python3 benchmarks/studies/quant_nf4_shuffle.py 2>&1 | tee "$out/nf4_study.txt" | tail -30
fi
if [[ $steps == *wgmma* && $family == quant ]]; then
  # The Gluon Hopper kernel (asynchronous wgmma, issue 24): its GPU tests, then the study (checks, then times).
  timeout ${WGMMA_TESTS_S:-150} python3 -m pytest -q -rfE packages/quant/tests/test_wgmma.py -x 2>&1 | tee "$out/wgmma_tests.txt" | tail -8
  if grep -q " passed" "$out/wgmma_tests.txt" && ! grep -qE "failed|error" "$out/wgmma_tests.txt"; then
    timeout ${WGMMA_STUDY_S:-240} python3 benchmarks/studies/quant_wgmma.py 2>&1 | tee "$out/wgmma_study.txt" | tail -60
  fi
fi
if [[ $steps == *tc* && $family == quant ]]; then
  # The tensor-core GEMV (int4_tc.cu, the default for 1-8 rows of x on sm_90): its variants
  # against Triton, tinygemm and F.linear (kernel time), its GPU tests, the public op's eager
  # wall time, then one Llama-style 1B decode step in a CUDA graph, int4 against bf16 weights.
  # The ring-fed study variant (config "tcr-...", bulk copies) is timed only if each of its
  # configs first ran clean in its own process (check_tc_gpu.py).
  tcr=$(python3 -c "from openkernels.quant import cuda as G; print(','.join(G.TCR_CONFIGS))")
  tc=$(python3 -c "from openkernels.quant import cuda as G; print(','.join(G.TC_CONFIGS))")
  if timeout ${TCR_CHECK_S:-200} python3 benchmarks/gpu/check_tc_gpu.py --configs "$tcr" 2>&1 | tee "$out/tcr_check.txt" | tail -16 \
      && [[ ${PIPESTATUS[0]} == 0 ]]; then tc="$tc,$tcr"; fi
  timeout ${TC_S:-240} python3 benchmarks/studies/quant_tc_gemv.py --configs "$tc" \
    --shapes ${TC_SHAPES:-8192x8192,28672x8192,2048x2048,3072x2048,16384x2048,2048x8192} 2>&1 \
    | tee "$out/tc_study.txt" | grep -v '^\[ *[0-9.]*s\]   ' | tail -100
  if [[ ${TC_WALL:-1} == 1 ]]; then
    timeout 150 python3 -m pytest -q -rfE packages/quant/tests/test_gemv.py -k "tensor_core_gemv" -m "not aot" -x 2>&1 \
      | tee "$out/tc_tests.txt" | tail -4
    timeout ${WALL_S:-150} python3 benchmarks/studies/quant_wgmma_wall.py --shapes 8192x8192,28672x8192 --ms 1,4,16 2>&1 \
      | tee "$out/tc_wall.txt" | tail -30
  fi
  (cd benchmarks/peers && timeout ${E2E_S:-200} python3 e2e_decode_step.py --context 4096 --reps 50 --mode graph ${E2E_PROFILE:+--profile $E2E_PROFILE} 2>&1 \
    | tee "$out/tc_e2e.txt" | grep -v "^ *[\"{}\[]" | tail -100)
  if [[ ${E2E_AB:-0} == 1 ]]; then  # the same step with kernelize leaving the decoder layers (no add + norm fusion)
    (cd benchmarks/peers && timeout ${E2E_S:-200} python3 e2e_decode_step.py --context 4096 --reps 50 --mode graph \
      ${E2E_PROFILE:+--profile $E2E_PROFILE} --skip 'model.layers.?,model.layers.??' 2>&1 \
      | tee "$out/tc_e2e_unfused.txt" | grep -v "^ *[\"{}\[]" | tail -100)
  fi
fi
if [[ $steps == *pdl* && $family == quant ]]; then
  # The tensor-core GEMV launched as a programmatic dependent (config suffix "-p", quant 0.10.5,
  # forced only): its GPU tests, its configs beside the plain ones back to back in a graph (each
  # GEMV a dependent of the one before), then the 1B decode step with the default configs and
  # with their "-p" variants (two runs; carry .whl: transformers 5.24).
  timeout ${PDL_TESTS_S:-300} python3 -m pytest -q -rfE packages/quant/tests/test_gemv.py -k "dependent and cuda" -m "not aot" -x \
    2>&1 | tee "$out/pdl_tests.txt" | tail -4
  pdl=$(python3 -c "from openkernels.quant import cuda as G; print(','.join(G.TC_PDL_CONFIGS + ('tc-t1-u2', 'tc-t2-u2', 'tc-t4-u1') + G.TC_SPLIT_CONFIGS[:1] + G.TC_SPLIT_CONFIGS[3:4] + G.TC_SPLIT_CONFIGS[5:]))")
  timeout ${TC_S:-240} python3 benchmarks/studies/quant_tc_gemv.py --ms 1 --configs "$pdl" \
    --shapes ${TC_SHAPES:-2048x2048,3072x2048,16384x2048,2048x8192,8192x8192,28672x8192} 2>&1 \
    | tee "$out/pdl_study.txt" | grep -v '^\[ *[0-9.]*s\]   ' | tail -80
  for routes in "" pdl; do
    (cd benchmarks/peers && timeout ${E2E_S:-200} python3 e2e_decode_step.py --context 4096 --reps 50 --mode graph --int4-head \
      ${routes:+--tc-routes $routes} ${E2E_PROFILE:+--profile $E2E_PROFILE} 2>&1 \
      | tee "$out/pdl_e2e_${routes:-default}.txt" | grep -v "^ *[\"{}\[]" | tail -60)
  done
fi
if [[ $steps == *wall* && $family == quant ]]; then
  # The wgmma kernel through the public op (launch plan, direct launch): its GPU tests, then
  # eager wall and kernel time against the default and F.linear (benchmarks/studies/quant_wgmma_wall.py).
  timeout ${WGMMA_TESTS_S:-150} python3 -m pytest -q -rfE packages/quant/tests/test_wgmma.py -x 2>&1 | tee "$out/wgmma_tests.txt" | tail -8
  timeout ${WALL_S:-240} python3 benchmarks/studies/quant_wgmma_wall.py 2>&1 | tee "$out/wgmma_wall.txt" | tail -40
fi
if [[ $steps == *largem* && $family == quant ]]; then
  # The wgmma kernel's quant 0.10.8 defaults (256-row bands from M = 256, scales two steps
  # ahead, K split up to M = 128): their GPU tests, the public op as routed against F.linear
  # (the split defaults were timed only as forced configs), and the large-M study's defaults.
  timeout ${WGMMA_TESTS_S:-150} python3 -m pytest -q -rfE packages/quant/tests/test_wgmma.py -x \
    -k "split_k or large_m or nf4 or fp16_scales or repeated or (forced and 4096)" 2>&1 | tee "$out/largem_tests.txt" | tail -4
  timeout ${WALL_S:-200} python3 benchmarks/studies/quant_wgmma_wall.py --shapes 8192x8192,28672x8192,2048x8192,4096x4096 \
    --ms 64,128,256,2048 2>&1 | tee "$out/largem_wall.txt" | tail -20
  # NF4 on the wgmma kernel against the routed public op (by default at 64-1024 rows since quant 0.10.9).
  timeout ${NF4_S:-150} python3 benchmarks/studies/quant_wgmma_large_m.py --kind nf4 --ms 64,128,2048 \
    --shapes 8192x8192,28672x8192 --configs m64n64k128s3a2x2,m128n64k128s3a2x2,m256n128k64s4 2>&1 | tee "$out/largem_nf4.txt" | grep -v "^\[" | tail -12
fi
if [[ $steps == *route* && $family == quant ]]; then
  # Routing data for quant 0.10.9: the forced wgmma kernel against Triton below 4096 x 4096 and
  # at N = 4096 (M = 16-96, the calls slower_than_triton still sends to Triton), K split past
  # 128 rows (auto = config_for) against one split, and NF4 on the kernel against its Triton path.
  timeout ${WGMMA_TESTS_S:-120} python3 -m pytest -q -rfE packages/quant/tests/test_wgmma.py -x \
    -k "split_k or large_m or nf4" 2>&1 | tee "$out/route_tests.txt" | tail -4
  timeout ${WALL_S:-200} python3 benchmarks/studies/quant_wgmma_wall.py \
    --shapes 4096x4096,2048x8192,4096x14336,14336x4096,2048x2048,8192x2048 --ms 16,32,64,96 2>&1 \
    | tee "$out/route_wall.txt" | grep "^|"
  timeout ${WGMMA_STUDY_S:-150} python3 benchmarks/studies/quant_wgmma_large_m.py --ms 256,512,1024 \
    --shapes 2048x8192,4096x4096,2048x2048,8192x8192 --configs auto,m128n64k128s3a2x1,m128n64k128s3a2x2,m128n64k128s3a2x4 \
    2>&1 | tee "$out/route_split.txt" | grep -A40 "best wgmma"
  timeout ${NF4_S:-150} python3 benchmarks/studies/quant_wgmma_large_m.py --kind nf4 --ms 16,64,128,256,512,1024 \
    --shapes 8192x8192,28672x8192,4096x4096 --configs auto 2>&1 | tee "$out/route_nf4.txt" | grep -A40 "best wgmma"
fi
if [[ $steps == *persist* && $family == quant ]]; then
  # Persistent programs of the wgmma kernel (quant 0.10.9, forced only: gluon.PERSISTENT_STUDY)
  # against the default tiles at M = 512-4096: their GPU tests, then kernel time.
  timeout ${WGMMA_TESTS_S:-120} python3 -m pytest -q -rfE packages/quant/tests/test_wgmma.py -x \
    -k "persistent or split_k or large_m" 2>&1 | tee "$out/persist_tests.txt" | tail -4
  timeout ${WGMMA_STUDY_S:-240} python3 benchmarks/studies/quant_wgmma_large_m.py --ms 512,1024,2048,4096 \
    --shapes 8192x8192,28672x8192,14336x4096,4096x14336 --configs auto,m256n128k64s4a1x1p,m128n128k128s4a2x1p \
    2>&1 | tee "$out/persist_study.txt" | grep -A40 "best wgmma"
fi
if [[ $steps == *bars* && $family == quant ]]; then
  # Issue 24's bars in one call (carry .whl: transformers for the decode step): M = 1 and 16
  # kernel time at the bar's shapes beside tinygemm and F.linear, the stored rows and the tiled
  # codes (quant 0.10.7); the public op's eager wall at M = 1, 16, 128, 2048; the 1B decode step.
  timeout ${TC_S:-200} python3 benchmarks/studies/quant_tc_gemv.py --ms 1,16 --shapes 8192x8192,28672x8192 \
    --configs tc-t2-u2,tc-t4-u1,tc-t4-u1-k2 --tiled 2>&1 | tee "$out/bars_tc.txt" | grep -v "^\[" | tail -40
  timeout ${WALL_S:-200} python3 benchmarks/studies/quant_wgmma_wall.py --shapes 8192x8192,28672x8192 \
    --ms 1,16,128,2048 2>&1 | tee "$out/bars_wall.txt" | tail -8
  timeout ${E2E_S:-150} python3 benchmarks/peers/e2e_decode_step.py --context 4096 --reps 50 --mode graph \
    --int4-head 2>&1 | tee "$out/bars_e2e.txt" | grep -E "ms per step|x ours bf16"
  # The same step with tiled codes (quant 0.10.15; attention 0.8.12 took a copy of them per layer out).
  timeout ${E2E_S:-150} python3 benchmarks/peers/e2e_decode_step.py --context 4096 --reps 50 --mode graph \
    --int4-head --layout tiled 2>&1 | tee "$out/bars_e2e_tiled.txt" | grep -E "ms per step|x ours bf16"
fi
if [[ $steps == *xsplit* && $family == quant ]]; then
  # The x-split tensor-core GEMV for 9-16 rows (quant 0.10.10, "-x2": one n8 tile of x per CTA,
  # two CTAs per tile of W): the tc GEMV's GPU tests (its entry point changed), then the x
  # split against the two-tile builds at M = 9 and 16.
  timeout ${XSPLIT_TESTS_S:-200} python3 -m pytest -q -rfE packages/quant/tests/test_gemv.py -m "not aot and not interpreter" \
    -k "cuda and (x_split or tensor_core_gemv_within or split_k or tiled_codes or replays)" 2>&1 \
    | tee "$out/xsplit_tests.txt" | tail -4
  timeout ${XSPLIT_S:-240} python3 benchmarks/studies/quant_tc_gemv.py --ms 9,16 \
    --shapes ${XSPLIT_SHAPES:-8192x8192,28672x8192,14336x4096,2048x8192,4096x4096} \
    --configs tc-t1-u2,tc-t2-u2,tc-t4-u1,tc-t1-u2-x2,tc-t2-u2-x2,tc-t4-u1-x2 2>&1 | tee "$out/xsplit.txt" \
    | grep -v "^\[" | tail -80
fi
if [[ $steps == *lookup* && $family == quant ]]; then
  # NF4 on the tensor-core GEMV (quant 0.10.11, its OK_TC_NF4 build): its GPU tests, then NF4
  # against int4 on the same configs at M = 1 / 8 / 16 (the public op's default for both kinds,
  # NF4's Triton path and CUDA GEMV), kernel time (issue 24: NF4 at int4's speed); NF4's kernels
  # with each lookup (quant 0.10.14: the table in shared memory, or the register lookup).
  timeout ${NF4TC_TESTS_S:-200} python3 -m pytest -q -rfE packages/quant/tests/test_gemv.py -m "not aot and not interpreter" \
    -k "cuda and nf4" 2>&1 | tee "$out/nf4tc_tests.txt" | tail -4
  timeout ${NF4TC_S:-240} python3 benchmarks/studies/quant_tc_gemv.py --kinds int4,nf4 --ms 1,8,16 \
    --shapes ${NF4TC_SHAPES:-8192x8192,28672x8192,2048x8192} --configs tc-t1-u2,tc-t2-u2,tc-t4-u1,tc-t1-u2-k2,tc-t4-u1-k2 \
    2>&1 | tee "$out/nf4tc.txt" | grep -v "^\[" | tail -90
fi
if [[ $steps == *layout* && $family == quant ]]; then
  # The codes' stored layout (quant 0.10.15, Int4Linear(layout="tiled")): its GPU tests, the
  # layers' eager wall and graph time rows against tiled, the 9-15-row routing fix, and the 1B
  # decode step with tiled codes (needs transformers 5.24 from .whl).
  timeout ${LAYOUT_TESTS_S:-200} python3 -m pytest -q -rfE packages/quant/tests/test_layout.py packages/quant/tests/test_wgmma.py \
    packages/quant/tests/test_gemv.py -m "not aot and not interpreter" -k "cuda and tiled or layer_on_the_gpu or 4d_view" \
    2>&1 | tee "$out/layout_tests.txt" | tail -4
  timeout ${LAYOUT_S:-200} python3 benchmarks/studies/quant_layout_wall.py 2>&1 | tee "$out/layout_wall.txt" | tail -40
  timeout 90 python3 benchmarks/studies/quant_m9_15_route.py 2>&1 | tee "$out/m9_15_route.txt" | tail -8
  timeout ${E2E_S:-240} python3 benchmarks/peers/e2e_decode_step.py --context 4096 --reps 50 --mode graph --int4-head \
    --layout tiled --json "$out/e2e_tiled.json" 2>&1 | tail -30
fi
if [[ $steps == *mconfigs* && $family == quant ]]; then
  # The wgmma kernel's configs at M = 128 and 2048 on this card (config_for was swept on the
  # H100 at these rows; issue 24's bars are the H200's): K splits, stages, band and tile sizes.
  timeout ${MCONF_S:-200} python3 benchmarks/studies/quant_wgmma_large_m.py --ms 128 --shapes 8192x8192,28672x8192 \
    --configs ${MCONF_128:-auto,m128n64k128s3a2x1,m128n64k128s4a2x2,m128n64k128s3a2x4,m64n64k128s3a2x1,m64n64k128s3a2x2,m128n128k128s3a2x1,m128n128k128s3a2x2,m128n64k64s6a1x2,m256n64k128s3a2x2} \
    2>&1 | tee "$out/mconfigs_128.txt" | grep -v "^\[" | tail -8
  grep -E "M=|us " "$out/mconfigs_128.txt" | tail -30
  timeout ${MCONF_S:-200} python3 benchmarks/studies/quant_wgmma_large_m.py --ms 2048 --shapes 8192x8192,28672x8192 \
    --configs ${MCONF_2048:-auto,m256n128k64s4a2x1,m256n128k64s3a1x1,m256n128k64s5a1x1,m128n128k128s4a2x1,m256n64k128s3a2x1,m256n128k128s3a2x1,m256n128k64s4a1x1p} \
    2>&1 | tee "$out/mconfigs_2048.txt" | grep -v "^\[" | tail -8
  grep -E "M=|us " "$out/mconfigs_2048.txt" | tail -24
fi
if [[ $steps == *genreport* && $family == quant ]]; then
  # Issue 24's generate() report: the kernelized 1B model with int4 weights (and lm_head)
  # against bf16 weights through a compiled generate() (carry .whl: transformers 5.24).
  (cd benchmarks/peers && timeout ${GENREPORT_S:-400} python3 e2e_kv_decode.py --models bf16,int4,int4-head \
    --formats bf16 --batches 1 --reps 3 --json "$out/genreport.json") 2>&1 | tee "$out/genreport.txt" | tail -6
fi
if [[ $steps == *alibi* && $family == attention ]]; then
  # Causal ALiBi's split bias (attention 0.8.7, plan.alibi_flag 2): its GPU tests (long
  # sequences, the option grid's causal ALiBi cases), then its cost against the plain call,
  # the kernels' forms ("int") beside attention 0.8.6's ("before": the absolute distance, and
  # ALiBi calls on the override configs for options).
  timeout ${ALIBI_TESTS_S:-240} python3 -m pytest -q -rfE packages/attention/tests/test_correctness.py -x \
    -k "cuda and (alibi_causal_long or ((alibi or cap) and (every_option_bf16 or fast_path)))" 2>&1 \
    | tee "$out/alibi_tests.txt" | tail -4
  timeout ${ALIBI_STUDY_S:-330} python3 benchmarks/studies/attention_alibi_distance.py ${ALIBI_VARIANTS:-int before} 2>&1 \
    | tee "$out/alibi_study.txt" | tail -40
  # A softcap alone on the plain configs too (attention 0.8.7) against 0.8.6's ("narrow").
  timeout ${SOFTCAP_STUDY_S:-240} python3 benchmarks/studies/attention_softcap_tanh.py ${SOFTCAP_VARIANTS:-mufu narrow} 2>&1 \
    | tee "$out/softcap_study.txt" | grep "|"
fi
if [[ $steps == *combine* && $family == attention ]]; then
  # The split combine's one-tile load (attention 0.8.9; plan.COMBINE_SPLITS_TILE, the default
  # from 0.8.10): the split tests with both forms, then both timed in one process.
  timeout ${COMBINE_TESTS_S:-150} python3 -m pytest -q -rfE packages/attention/tests/test_kvcache.py \
    -m "not aot and not interpreter" -k "cuda and (forced_splits or long_context)" 2>&1 | tee "$out/combine_tests.txt" | tail -3
  timeout ${COMBINE_STUDY_S:-150} python3 benchmarks/studies/kvcache_combine_tile.py 2>&1 | tee "$out/combine_tile.txt" | grep "|"
fi
if [[ $steps == *kvshort* && $family == attention ]]; then
  # The 1B step's decode attention (B1 S4096 GQA 32/8 D64, 16 caches rotated past the L2):
  # configs x splits and the combine's one-tile load against the shipped plan.
  timeout ${KVSHORT_S:-240} python3 benchmarks/studies/kvcache_short_decode.py ${KVSHORT_ARGS:-} 2>&1 \
    | tee "$out/kvshort.txt" | tail -24
fi
if [[ $steps == *dropout* && $family == attention ]]; then
  # Dropout alone in full calls on the plain fast configs (problem.FULL_DROPOUT_ON_PLAIN_CONFIGS,
  # off by default until this times it): its GPU test, then the study's two variants.
  timeout ${DROPOUT_TESTS_S:-150} python3 -m pytest -q -rfE packages/attention/tests/test_dropout.py \
    -k "plain_configs and cuda" 2>&1 | tee "$out/dropout_tests.txt" | tail -3
  timeout ${DROPOUT_STUDY_S:-200} python3 benchmarks/studies/attention_dropout_configs.py 2>&1 \
    | tee "$out/dropout_study.txt" | grep "|"
fi
if [[ $steps == *backward* && $family == attention ]]; then
  # The Gluon backward behind the default (cuDNN) forward at every study shape, against the
  # default (Triton backward) and SDPA cuDNN: where it would go by default.
  timeout ${BACKWARD_S:-240} python3 benchmarks/studies/attention_gluon.py --backward 2>&1 | tee "$out/gluon_backward.txt" | tail -20
fi
if [[ $steps == *bwdsweep* && $family == attention ]]; then
  # The Gluon backward's configs against the Triton backward (checked, then timed), issue 23.
  timeout ${BWDSWEEP_S:-240} python3 benchmarks/studies/attention_gluon.py --backward-sweep 2>&1 | tee "$out/gluon_bwd_sweep.txt" | tail -12
fi
if [[ $steps == *split* && $family == layernorm ]]; then
  # The split forward's variants (one-pass LayerNorm statistics, warps, narrow hold) against copy.
  timeout ${SPLIT_S:-300} python3 benchmarks/studies/norm_split_variants.py 2>&1 | tee "$out/split_study.txt" | tail -40
fi
if [[ $steps == *check* && -f benchmarks/gpu/check_${family}_gpu.py ]]; then
  run "benchmarks/gpu/check_${family}_gpu.py" | tee "$out/check.txt" | grep -E "BAD|checks passed"
fi
if [[ $steps == *tune* && -f benchmarks/tuning/tune_$family.py ]]; then
  run "benchmarks/tuning/tune_$family.py" | tee "$out/tune.txt" | tail -3
fi
if [[ $steps == *hosttime* ]]; then
  # Every public op's host time per call against torch's, Triton's launch and the direct one.
  run -m benchmarks.peers.host_time --direct-launch both --json "$out/host_time.json" | tee "$out/host_time.txt"
fi
if [[ $steps == *bench* ]]; then
  peers=()
  if [[ $family == attention ]]; then
    # TFLOP/s against the bf16 matmul; every fused SDPA backend forced in turn, FlexAttention.
    peers=(--peers sdpa-flash,sdpa-cudnn,sdpa-efficient,flex)
  fi
  run benchmarks/peers/run.py "$family" ${peers[@]+"${peers[@]}"} --kernel-time --json "$out/bench_bf16.json" \
    | tee "$out/bench_bf16.txt"
fi
if [[ $steps == *long* && $family == layernorm ]]; then
  # ours:cluster (the sm_90 cluster forward, forced) beside the Triton path and QuACK.
  run benchmarks/peers/run.py layernorm --shapes 4096x16384,1024x65536,512x131072,256x262144,64x1048576 --kernel-time --json "$out/bench_long.json" \
    | tee "$out/bench_long.txt"
fi
if [[ $steps == *dtypes* ]]; then
  if [[ $family == activations ]]; then
    args=(--ops silu_and_mul,gelu_and_mul)
  elif [[ $family == attention ]]; then
    # fp16 forward only: the kernels take fp16 and bf16 (fp32 is not a fused-kernel dtype).
    args=(--peers sdpa-flash,sdpa-cudnn,sdpa-efficient,flex --directions fwd)
  else
    args=(--ops rms_norm,layer_norm --directions fwd)
  fi
  dtypes=float16,float32
  [[ $family == attention ]] && dtypes=float16
  run benchmarks/peers/run.py "$family" --dtype "$dtypes" "${args[@]}" \
    --json "$out/bench_f16_f32.json" | tee "$out/bench_f16_f32.txt"
fi
if [[ $steps == *decode* && $family == attention ]]; then
  run benchmarks/peers/decode_attention.py --peers sdpa --formats ours,ours-fp8,ours-int8,ours-int4,ours-int4-keys32 \
    --shapes 32x32x8x4096x128,8x32x8x32768x128,1x32x8x131072x128,1x32x8x4096x128 --kernel-time --rep-ms 30 \
    --json "$out/decode.json" | tee "$out/decode.txt"
  (cd benchmarks/peers && run e2e_kv_decode.py --reps 1 --json "$out/e2e_kv.json") | tee "$out/e2e_kv.txt" | tail -12
fi
if [[ $steps == *replay* ]]; then
  # Eager replay on CUDA (on by default): replayed calls bitwise against the Python path, then host time.
  run benchmarks/gpu/check_replay_gpu.py | tee "$out/replay.txt" | tail -40
  run -m benchmarks.peers.host_time --json "$out/host_time_replay.json" | tee "$out/host_time_replay.txt"
fi
if [[ $steps == *demo* ]]; then
  run -m openkernels.shared check | tee "$out/check.txt" | grep -E "FAIL|checks|passed"
fi
