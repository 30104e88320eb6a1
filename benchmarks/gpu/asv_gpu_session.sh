#!/usr/bin/env bash
# asv on a lent GPU machine that has torch and triton but no network and no git history:
# asv and its dependencies travel as wheels in .whl/asv, the history as a git bundle
# (.whl/repo.bundle, made with `git bundle create .whl/repo.bundle main`). Results are
# copied to $OUT as they are written, so a run cut short still returns what it measured.
#
#   bash benchmarks/gpu/asv_gpu_session.sh STEP...
#     backfill:SECONDS      the kernel commits without results on this machine (lean set,
#                           forkserver launch), starting none after SECONDS
#     run:COMMIT            every benchmark that applies here, for one commit (spawn launch)
#     compare:BASE:HEAD     asv-compare's table and verdict for two commits (lean set)
#     noise:RUNS:SECONDS    HEAD benchmarked RUNS times (lean set), no run started after SECONDS;
#                           the spread file lands in $OUT/asv-noise
set -uo pipefail
OUT=${OUT:-/tmp/asv-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/asv/*.whl || exit 1
export PYTHONPATH=/tmp/site ASV_PYTHONPATH=/tmp/site
# A warm machine keeps /tmp: reuse the clone and the results an earlier call left there.
if [ ! -d /tmp/repo/.git ]; then git clone -q -b main .whl/repo.bundle /tmp/repo || exit 1; fi
cp benchmarks/asv_history.py /tmp/repo/benchmarks/ 2>/dev/null
mkdir -p /tmp/repo/benchmarks/gpu /tmp/repo/benchmarks/peers
cp benchmarks/gpu/asv_gpu_session.sh /tmp/repo/benchmarks/gpu/
cp -r benchmarks/asv_suite/. /tmp/repo/benchmarks/asv_suite/
# The e2e suite times these scripts by their path.
cp benchmarks/peers/e2e_models.py benchmarks/peers/e2e_kv_decode.py /tmp/repo/benchmarks/peers/
cd /tmp/repo || exit 1
git config user.email asv@localhost && git config user.name asv
results=$(python3 -c "import json; print(json.load(open('asv.conf.json'))['results_dir'])")
# One archive: the device returns a limited number of files.
keep() { tar czf "$OUT/results.tgz.part" -C "$results" . 2>/dev/null && mv "$OUT/results.tgz.part" "$OUT/results.tgz"; }
(while sleep 15; do keep; done) &
copier=$!
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
for step in "$@"; do
    IFS=: read -r kind a b <<<"$step"
    start=$(date +%s)
    case $kind in
    backfill) python3 benchmarks/asv_history.py backfill --lean --launch forkserver --budget-s "$a" 2>&1 | tee -a "$OUT/backfill.log" | grep -E "^asv:|budget|failed|Error" ;;
    run) python3 benchmarks/asv_history.py run "$a" ${b:+--families "$b"} 2>&1 | tee -a "$OUT/run.log" | grep -E "^asv:|failed|Error" ;;
    noise) python3 benchmarks/asv_history.py noise --lean --launch forkserver --runs "$a" --budget-s "${b:-0}" 2>&1 \
        | tee -a "$OUT/noise.log" | grep -E "^asv:|noise|spread|failed|Error"
        mkdir -p "$OUT/asv-noise" && cp benchmarks/results/asv-noise/*.json "$OUT/asv-noise/" 2>/dev/null ;;
    compare) python3 benchmarks/asv_history.py compare "$a" "$b" --lean --launch forkserver 2>&1 | tee -a "$OUT/compare.log" | tail -40 ;;
    esac
    echo "step $step: $(($(date +%s) - start)) s"
done
kill $copier 2>/dev/null
keep
