#!/usr/bin/env bash
# Check the GPU path of this checkout on one CUDA or ROCm GPU, in under 8 minutes:
#   a. torch sees a GPU          b. Triton kernels bit-exact vs the torch reference on it
#   c. pytest -m gpu tests       d. the quantization kernel benchmark (GB/s, % of a device copy)
#   e. one-device throughput: our step vs Hugging Face eager and torch.compile (1.01B shape)
#   f. memory: each phase's peak allocation vs the memory model's device terms (one process)
# Run it directly from anywhere: tools/gpu_check.sh  (PYTHON=... to choose the interpreter;
# GPU_CHECK_KEEP=DIR keeps each check's log, the throughput rows as JSON and the summary in DIR).
# Exit: 0 every check that ran passed, 1 a check failed, 77 no GPU visible (nothing checked).
# docs/gpu.md describes each check.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=.venv/bin/python
    [[ -x $PYTHON ]] || PYTHON=python3
fi
BUDGET_S=${GPU_CHECK_BUDGET_S:-460}
export PYTHONUNBUFFERED=1  # check output appears as it happens, not when a pipe buffer fills
START_S=$SECONDS
LOGS=$(mktemp -d)
KEEP=${GPU_CHECK_KEEP:-}
# On exit the logs go to GPU_CHECK_KEEP first when it is set: a device loan's output folder then
# brings back every number, not only the printed tail.
# shellcheck disable=SC2329  # invoked by the EXIT trap
keep_logs() {
    if [[ -n $KEEP ]] && mkdir -p "$KEEP"; then
        cp "$LOGS"/* "$KEEP"/ 2>/dev/null
    fi
    rm -rf "$LOGS"
}
trap keep_logs EXIT
SUMMARY=()
FAILED=0

# a. Is there a GPU? Without one, say so in one line and exit 77: nothing was checked.
probe='
import sys, torch
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} sees no GPU (CUDA {torch.version.cuda}, HIP {torch.version.hip})")
    sys.exit(3)
runtime = f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
print(f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}, {runtime}")
'
gpu=$(timeout -k 5 60 "$PYTHON" -c "$probe" 2>&1)
rc=$?
if [[ $rc -eq 3 ]]; then
    echo "gpu_check: SKIP: no GPU: $gpu; nothing checked"
    exit 77
elif [[ $rc -ne 0 ]]; then
    echo "gpu_check: FAIL: $PYTHON could not probe the GPU (rc $rc): ${gpu##*$'\n'}"
    exit 1
fi
echo "== a. GPU: $gpu"

# run_check NAME CAP_S CMD...: run CMD under the smaller of CAP_S and the budget left, echoing
# its output and keeping it in $LOGS/NAME.log; sets RC (124: timed out).
run_check() {
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET_S - (SECONDS - START_S)))
    ((left < cap)) && cap=$left
    if ((cap < 10)); then
        echo "== $name: not run, the ${BUDGET_S} s budget is spent" | tee "$LOGS/$name.log"
        RC=124
        return
    fi
    echo "== $name (timeout ${cap} s): $*"
    timeout -k 10 "$cap" "$@" 2>&1 | tee "$LOGS/$name.log"
    RC=${PIPESTATUS[0]}
}

# rc_text: why the last check failed, in words where timeout set the code.
rc_text() {
    if ((RC == 124 || RC == 137)); then echo "timed out"; else echo "rc $RC"; fi
}

# record STATUS LABEL DETAIL: one summary line; any FAIL makes the exit code 1.
record() {
    SUMMARY+=("$(printf '%-5s %-19s %s' "$1" "$2" "$3")")
    [[ $1 == FAIL ]] && FAILED=1
}
record PASS "a. gpu visible" "$gpu"

# Skipped rather than failed without triton: it is the optional `gpu` extra.
if timeout -k 5 60 "$PYTHON" -c "import triton" >/dev/null 2>&1; then HAVE_TRITON=1; else HAVE_TRITON=0; fi

# b. every self-check case (both bit widths) bit for bit against the reference, on the device
if ((HAVE_TRITON)); then
    run_check triton_check 150 "$PYTHON" -m megatron.ops.quant check --impl triton --device cuda
    ok=$(grep -c '^ok ' "$LOGS/triton_check.log")
    bad=$(grep -c '^FAIL' "$LOGS/triton_check.log")
    if [[ $RC -eq 0 && $bad -eq 0 && $ok -gt 0 ]]; then
        record PASS "b. triton bit-exact" "$ok/$ok cases"
    else
        record FAIL "b. triton bit-exact" "$ok ok, $bad FAIL ($(rc_text))"
    fi
else
    record SKIP "b. triton bit-exact" "triton is not installed (pip install -e '.[gpu]')"
fi

# c. the gpu-marked tests: Triton on device tensors, bf16 training, fp32 GPU-vs-CPU first loss
run_check pytest_gpu 180 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py
last=$(grep -E '(passed|failed|skipped|error)' "$LOGS/pytest_gpu.log" | tail -n 1 | tr -d '=')
last=$(echo "${last:-no result line}" | sed 's/^ *//; s/ *$//')
if [[ $RC -eq 0 && $last == *passed* ]]; then
    record PASS "c. pytest -m gpu" "$last"
elif [[ $RC -eq 0 ]]; then
    record SKIP "c. pytest -m gpu" "$last"
else
    record FAIL "c. pytest -m gpu" "$last ($(rc_text))"
fi

# d. kernel throughput on 16M elements at the default block (GB/s = bytes read + written / time)
if ((HAVE_TRITON)); then
    run_check bench 90 "$PYTHON" bench/quant_kernels.py --device cuda --sizes 16M --blocks 2048 \
        --repeat 3
    # Columns are fixed width: op at 25-42, GB/s at 52-59, % of the copy rate last (bench_size's formats).
    rates=$(awk '/^torch /{printf "clone %.0f", substr($0, 52, 8)}
                 /^triton / && NF > 6 {op = substr($0, 25, 18); sub(/ .*/, "", op);
                     sub(/reduce_requant/, "reduce", op);
                     printf ", int%s %s %.0f (%.0f%%)", $2, op, substr($0, 52, 8), $NF}' "$LOGS/bench.log")
    if [[ $RC -eq 0 && $rates == *int8* ]]; then
        record PASS "d. bench GB/s" "$rates"
    else
        record FAIL "d. bench GB/s" "$(rc_text), no triton rows (${rates:-nothing parsed})"
    fi
else
    record SKIP "d. bench GB/s" "triton is not installed"
fi

# e. our training step against HF GPTNeoXForCausalLM eager and compiled, same weights and batches
# (--breakdown: one more, profiled step per row; the log's last table says where each row's time goes)
run_check throughput 240 "$PYTHON" bench/gpu_throughput.py --steps 10 --warmup 3 --breakdown \
    --json "$LOGS/throughput.json"
table=$("$PYTHON" - "$LOGS/throughput.json" <<'PY' 2>/dev/null
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
parts = []
for r in rows:
    mfu = "" if r["mfu"] is None else " MFU %.0f%%" % (100 * r["mfu"])
    ratio = "-" if r["vs_hf_compile"] is None else "%.3fx" % r["vs_hf_compile"]
    idle = "" if r.get("breakdown") is None else ", idle %.1f ms" % r["breakdown"]["idle_ms"]
    parts.append("%s %.4f s %.0f TFLOPS%s %.1f GB, vs hf_compile %s%s"
                 % (r["row"], r["s_per_step"], r["tflops"], mfu, r["peak_bytes"] / 1e9, ratio, idle))
print("; ".join(parts))
PY
)
if [[ $RC -eq 0 && -n $table ]]; then
    record PASS "e. throughput" "$table"
else
    record FAIL "e. throughput" "$(rc_text), ${table:-no table}"
fi

# f. the memory model's device terms against the GPU's peak allocation per phase (one process)
run_check memory 120 "$PYTHON" bench/memory.py --device cuda --layout none --load-layout none \
    --layers 8 --hidden 2048 --heads 16 --seq 1024 --configs zero3 --set bf16.enabled=true
# rows "zero3  <phase>  <run>  baseline  measured  predicted  measured/predicted": phase and ratio
ratios=$(awk '$1 == "zero3" && $2 ~ /^(build|step|save|load)$/ {printf "%s%s %s", sep, $2, $NF; sep = ", "}' \
    "$LOGS/memory.log")
[[ -n $ratios ]] && ratios="measured/predicted: $ratios"
if [[ $RC -eq 0 && -n $ratios ]]; then
    record PASS "f. memory vs model" "$ratios"
else
    record FAIL "f. memory vs model" "$(rc_text), ${ratios:-no zero3 row}"
fi

{
    echo
    echo "== gpu_check summary ($gpu)"
    printf '%s\n' "${SUMMARY[@]}"
    echo "total $((SECONDS - START_S)) s of a ${BUDGET_S} s budget"
} | tee "$LOGS/summary.txt"
exit "$FAILED"
