#!/usr/bin/env bash
# One device loan's measurements in one call, every result in OUT_DIR as at most 5 files (the
# device tool brings back 8 at most, and nothing after a call it had to kill):
#   1. tools/gpu_check.sh, checks a-f                -> summary.txt, throughput.json
#   2. the INT4 kernel A/B: our Triton INT4 kernels beside their stride-2 baseline (impl
#      triton_strided4: the fp32 side at stride 2, as before 145ef0a), same device clock
#                                                    -> kernels_ab.log
#   3. the rows check e does not run, and the compiled rows again, each with its chrome trace
#                                                    -> more_rows.json
#   every log and trace                              -> logs.tgz
# Usage: tools/gpu_loan.sh OUT_DIR
#   GPU_LOAN_BUDGET_S  the whole run's budget in seconds (default 565; give the call 590)
#   PYTHON             the interpreter, as for gpu_check.sh
# Exit: gpu_check.sh's code (77: no GPU, nothing else run). docs/gpu.md, "After", has the call.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT_DIR=${1:?usage: tools/gpu_loan.sh OUT_DIR}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd) || exit 1
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=.venv/bin/python
    [[ -x $PYTHON ]] || PYTHON=python3
fi
export PYTHON PYTHONUNBUFFERED=1
BUDGET_S=${GPU_LOAN_BUDGET_S:-565}
START_S=$SECONDS
WORK=$(mktemp -d)

# On every exit what was made reaches OUT_DIR: the small results as files, all of it in one archive.
# shellcheck disable=SC2329  # invoked by the EXIT trap
finish() {
    local name
    for name in summary.txt throughput.json kernels_ab.log more_rows.json; do
        [[ -f $WORK/$name ]] && cp "$WORK/$name" "$OUT_DIR/"
    done
    tar czf "$OUT_DIR/logs.tgz" -C "$WORK" .
    rm -rf "$WORK"
}
trap finish EXIT

seconds_left() { echo $((BUDGET_S - (SECONDS - START_S))); }

# 1. The checks, leaving steps 2 and 3 about 175 s (check e alone may take its 240 s: two cold compiles).
GPU_CHECK_BUDGET_S=$((BUDGET_S - 175)) GPU_CHECK_KEEP=$WORK tools/gpu_check.sh
rc=$?
((rc == 77)) && exit 77

# 2. The kernel A/B (each impl checked bit for bit against the reference before it is timed).
cap=$(($(seconds_left) - 120))
((cap > 50)) && cap=50
if ((cap < 10)); then
    echo "gpu_loan: kernel A/B not run: the ${BUDGET_S} s budget is spent" | tee "$WORK/kernels_ab.log"
else
    echo "== kernel A/B (timeout ${cap} s)"
    timeout -k 5 "$cap" "$PYTHON" bench/quant_kernels.py --device cuda --sizes 16M --blocks 2048 \
        --bits 4 --impls triton,triton_strided4 --repeat 3 2>&1 | tee "$WORK/kernels_ab.log"
fi

# 3. More rows, traced: fused loss with compile, both recomputes, and the two compiled rows whose
#    traces say where ours and HF's compiled steps differ.
cap=$(($(seconds_left) - 15))
if ((cap < 30)); then
    echo "gpu_loan: more rows not run: the ${BUDGET_S} s budget is spent" | tee "$WORK/more_rows.log"
else
    echo "== more rows (timeout ${cap} s)"
    timeout -k 5 "$cap" "$PYTHON" bench/gpu_throughput.py \
        --rows ours_compile,hf_compile,ours_compile_fused_ce,ours_selective,ours_recompute \
        --steps 10 --warmup 3 --trace-dir "$WORK/traces" --json "$WORK/more_rows.json" 2>&1 | tee "$WORK/more_rows.log"
fi
echo "gpu_loan: $((SECONDS - START_S)) s of a ${BUDGET_S} s budget; results in $OUT_DIR"
exit "$rc"
