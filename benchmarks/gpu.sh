#!/usr/bin/env bash
# The GPU measurements in one command that ends within about MINUTES minutes (default 9):
#   0. tests/test_cuda.py: a small GPT held to small budgets, where cuBLAS's workspaces matter,
#      then benchmarks/cuda_peak.py: what is alive at that GPT's measured peak at its floor;
#   1. benchmarks/budget_check.py --device cuda: the GPT-2-small-shaped GPT held by the planner
#      alone (passes=()) to 80%, 60% and 50% of eager's measured peak, then with the default
#      passes at its floor (torch.cuda.max_memory_allocated against each budget);
#   2. benchmarks/run.py --device cuda on MODELS (default: gpt), with the time that is left;
#   or, as part peak, benchmarks/cuda_peak.py on each of MODELS at its CUDA size, unconstrained
#   and at its floor (what is alive at the measured peak beside the plan's), into peak-MODEL.log.
# The budget check rewrites its report after every point; run.py after every model, and when it
# is stopped. Eight files in all: three logs, two from the budget check, three from run.py (with
# one model).
#
#     bash benchmarks/gpu.sh [OUT_DIR] [MINUTES] [MODELS] [PARTS] [RUN_ARGS]
#
# PARTS: which of tests, budget, peak and bench to run, comma-separated (default tests, budget
# and bench): with bench alone, the benchmark has the whole time for MODELS. RUN_ARGS: more
# options for run.py (say --quick: one activation_memory_budget and one fxmem budget beside its
# floor, at the model's GPU size when it has no quick one).
# TESTS_LIMIT: seconds for tests/test_cuda.py (default 16 per minute of the run); PEAK_BUDGETS:
# the budgets of part peak (default "unconstrained floor").
# OUT_DIR defaults to $OUT, else benchmarks/results. Needs python3 with torch (CUDA), numpy,
# networkx, scipy, safetensors and pytest; fxmem itself is installed into a temporary folder
# when python3 cannot import it. Exit status: 0 when every part run succeeded; else the tests'
# or cuda_peak.py's (1: a test failed), else the budget check's (1: a budget or gradient check
# failed; 3: the time limit left points unmeasured), else run.py's; 5 when one had to be killed
# at its time limit.
set -uo pipefail
out=${1:-${OUT:-benchmarks/results}}
case "$out" in /*) ;; *) out=$PWD/$out ;; esac
minutes=${2:-9}
models=${3:-gpt}
parts=,${4:-tests,budget,bench},
read -r -a run_args <<<"${5:-}"
wants() { case "$parts" in *,"$1",*) return 0 ;; esac; return 1; }
for p in ${parts//,/ }; do
    case "$p" in tests | budget | peak | bench) ;; *) echo "PARTS: unknown part '$p' (tests, budget, peak, bench)" >&2; exit 2 ;; esac
done
case "$minutes" in '' | *[!0-9]*) echo "MINUTES must be a whole number, got '$minutes'" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
root=$PWD
export PYTHONUNBUFFERED=1
mkdir -p "$out"
start=$(date +%s)
left() { echo $((minutes * 60 - ($(date +%s) - start))); }

# `fxmem.passes` lives in passes/ and only the install maps it there (pyproject.toml): a plain
# checkout on sys.path does not provide it. So fxmem is imported as installed, and Python runs
# outside the checkout's root (python3 -c and -m put the working folder first on sys.path).
# Without network or build tools, the install is laid out by hand: the package, passes/ as
# fxmem/passes, and a dist-info that registers the torch_dynamo_backends entry point.
if ! (cd /tmp && python3 -c "import fxmem.passes") 2>/dev/null; then
    site=$(mktemp -d)
    cp -r fxmem "$site/fxmem" && cp -r passes "$site/fxmem/passes" || exit 1
    info=$site/fxmem-0.1.0.dist-info
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: fxmem\nVersion: 0.1.0\n' >"$info/METADATA"
    sed -n '/^\[project.entry-points.torch_dynamo_backends\]/,/^$/p' pyproject.toml |
        sed -e 's/^\[project.entry-points.torch_dynamo_backends\]/[torch_dynamo_backends]/' -e 's/"//g' \
            >"$info/entry_points.txt"
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
(cd /tmp && python3 -c "
import sys; sys.path.append('$root')
import torch, numpy, fxmem.passes, benchmarks._harness
print('torch', torch.__version__, torch.cuda.get_device_name(0))") || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null

killed() { [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; }

# The tests and cuda_peak.py take at most a third of the time together.
tests=0
if wants tests; then
    (cd tests && timeout -k 10 "${TESTS_LIMIT:-$((minutes * 16))}" python3 -m pytest -q -p no:cacheprovider --durations=0 \
        test_cuda.py) 2>&1 | tee "$out/test-cuda.log"
    tests=${PIPESTATUS[0]}
    # What is alive at the measured peak beside what the plan predicted there (the small GPT at
    # its floor with the default passes), appended to the tests' log; its failure is the tests'.
    (cd /tmp && timeout -k 5 $((minutes * 4)) python3 "$root/benchmarks/cuda_peak.py") 2>&1 |
        grep -v "^W[0-9]" | tee -a "$out/test-cuda.log"
    peak_status=${PIPESTATUS[0]}
    [ "$tests" -eq 0 ] && tests=$peak_status
fi

# The budget check ends by 65% of the time; it starts no point past 50%.
check=0
if wants budget; then
    if [ $(($(left) - minutes * 30)) -gt 0 ]; then
        timeout -k 20 $(($(left) - minutes * 21)) python3 benchmarks/budget_check.py --device cuda \
            --time-limit $(($(left) - minutes * 30)) --out-dir "$out/budget-cuda" 2>&1 | tee "$out/budget-cuda.log"
        check=${PIPESTATUS[0]}
    else
        echo "budget check not run: $(left) s left" | tee "$out/budget-cuda.log"
        check=3
    fi
fi

# cuda_peak.py on each model, unconstrained then at its floor, each started while more than a
# minute is left; a failure counts as the tests'.
if wants peak; then
    for m in ${models//,/ }; do
        for b in ${PEAK_BUDGETS:-unconstrained floor}; do
            if [ "$(left)" -gt 60 ]; then
                (cd /tmp && timeout -k 5 $(($(left) - 20)) python3 "$root/benchmarks/cuda_peak.py" --model "$m" \
                    --budget "$b") 2>&1 | grep -v "^W[0-9]" | tee -a "$out/peak-$m.log"
                status=${PIPESTATUS[0]}
                [ "$status" -eq 0 ] || tests=$status
            fi
        done
    done
fi

# The benchmark starts no configuration in its last 100 s, which leave time for its steps: past
# its time limit it runs two timed rounds (gradients, then peaks) and ends them.
bench=0
remaining=$(left)
if ! wants bench; then
    :
elif [ "$remaining" -gt 120 ]; then
    timeout -k 10 $((remaining - 15)) python3 benchmarks/run.py --device cuda --models "$models" \
        --time-limit $((remaining - 100)) --out-dir "$out/cuda" "${run_args[@]}" 2>&1 | tee "$out/cuda.log"
    bench=${PIPESTATUS[0]}
else
    echo "benchmark not run: ${remaining} s left"
fi
echo "exit statuses: tests ${tests}, budget check ${check}, benchmark ${bench}; $(($(date +%s) - start)) s in all"
if killed "$tests" || killed "$check" || killed "$bench"; then exit 5; fi
[ "$tests" -ne 0 ] && exit "$tests"
[ "$check" -ne 0 ] && exit "$check"
exit "$bench"
