#!/usr/bin/env bash
# A same-run A/B of the GPU kernels: `moestudio bench kernels` in a base commit's tree and in this
# one, on one machine, one after the other (what METHOD.md asks of a speed claim: ratios from one
# run). Two steps, because the device's copy of the tree has no git history:
#   here:    bash scripts/kernels_ab.sh prepare BASE     (BASE: a commit; writes .ab/, ignored by git)
#   device:  bash scripts/kernels_ab.sh run [bench kernels options]     (carry: .whl and .ab)
#            e.g. bash scripts/kernels_ab.sh run --only experts --rows 1,8 --replays 3
# Results in $OUT: ab_base.log, ab_new.log (each side's table) and ab.md (the two tables, base first).
set -u
MODE=${1:-}
shift $(( $# > 0 ? 1 : 0 ))
case "$MODE" in
  prepare)
    BASE=${1:?"usage: bash scripts/kernels_ab.sh prepare BASE-COMMIT"}
    rm -rf .ab && mkdir -p .ab/base
    git archive "$BASE" app engine | tar x -C .ab/base || exit 1
    git rev-parse --short "$BASE" > .ab/base/COMMIT
    echo "base $(cat .ab/base/COMMIT) in .ab/base; on the device: bash scripts/kernels_ab.sh run ..., carry .whl and .ab"
    ;;
  run)
    [ -f .ab/base/COMMIT ] || { echo "no .ab/base: run 'bash scripts/kernels_ab.sh prepare BASE' here and carry .ab"; exit 1; }
    OUT=${OUT:-/tmp/out}
    mkdir -p "$OUT"
    if compgen -G ".whl/*.whl" > /dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    fi
    export PYTHONUNBUFFERED=1
    for side in base new; do
      tree=$([ $side = base ] && echo "$PWD/.ab/base" || echo "$PWD")
      rm -rf "/tmp/ab_$side"  # a warm machine keeps /tmp: no earlier run's table in ab.md
      (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "${AB_TIMEOUT:-270}" python3 -m engine.cli bench kernels \
         --out "/tmp/ab_$side" "$@" > "$OUT/ab_$side.log" 2>&1)
      rc=$?
      echo "[$(date +%T)] $side ($([ $side = base ] && cat .ab/base/COMMIT || echo "this tree")) rc=$rc"
    done
    { echo "# base $(cat .ab/base/COMMIT)"; cat /tmp/ab_base/kernels.md; echo; echo "# this tree"
      cat /tmp/ab_new/kernels.md; } > "$OUT/ab.md" 2>/dev/null
    grep -hE "^(dense|experts|grouped)" "$OUT/ab_base.log" "$OUT/ab_new.log"
    ;;
  *)
    echo "usage: bash scripts/kernels_ab.sh prepare BASE-COMMIT | run [bench kernels options]"; exit 2 ;;
esac
