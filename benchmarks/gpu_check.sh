#!/usr/bin/env bash
# The GPU checks (`make gpu-check`): the device-parametrized core and adapter tests on CUDA,
# `benchmarks.compress --device cuda`, `benchmarks.host_syncs`, `benchmarks.gpu_profile` and
# the whole model step in buckets (`benchmarks.model_step --device cuda`). Needs PyTorch with
# CUDA, not Horovod. Each part has its own time limit, so that one that hangs leaves the
# others' results; the exit status is that of the first part that failed. OUT_DIR gets at
# most 8 files (what the device tool brings back): a .txt per part plus a .json for compress,
# syncs and profile; the C kernels' build log only if it fails. The device is named on stdout
# and in the parts' records.
#
#   benchmarks/gpu_check.sh [OUT_DIR] [PARTS...]    (PARTS: tests compress syncs profile model-step;
#                                                 default: all; TESTS=... overrides the test files)
set -u
OUT=${1:-results/gpu}
shift || true
PARTS=${*:-tests compress syncs profile model-step}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
status=0

part() {  # name, limit in seconds, command...
    local name=$1 limit=$2
    shift 2
    case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name ($(date -u +%H:%M:%S))"
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 60 "$OUT/$name.txt"
    echo "== $name: exit $rc"
    [ "$status" -ne 0 ] || status=$rc
}

# The CPU kernels are part of the adapter (the parity tests run them beside the GPU).
if ! "$PYTHON" -c "import horovod_dgc.torch.kernels" 2>/dev/null; then
    build_log=$(mktemp)
    "$PYTHON" setup.py -q build_ext --inplace > "$build_log" 2>&1 \
        || { mv "$build_log" "$OUT/build.txt"; echo "building the C kernels failed:"; tail -n 20 "$OUT/build.txt"; exit 1; }
    rm -f "$build_log"
fi

"$PYTHON" - <<'EOF'
import sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
EOF

# The in-process tests that take the `device` fixture (tests/conftest.py), the device parity,
# and the DDP hook's transport on CUDA tensors under torchrun (Gloo, and NCCL on one rank).
TESTS=${TESTS:-tests/test_core_references.py tests/test_core_selection.py tests/test_core_methods.py
    tests/test_codecs.py tests/test_core_twostage.py tests/test_core_sparse_allreduce.py
    tests/test_core_warmup.py tests/test_bad_input.py tests/test_device_torch.py tests/test_triton_memory.py
    tests/test_triton_bits.py tests/test_triton_messages.py tests/test_triton_selection.py tests/test_triton_signs.py
    tests/test_ddp_torch.py}
# shellcheck disable=SC2086
part tests 300 "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs -k "cuda or device_torch or triton or transport" $TESTS
part compress 120 "$PYTHON" -m benchmarks.compress --device cuda --json "$OUT/compress.json"
part syncs 150 "$PYTHON" -m benchmarks.host_syncs --steps 2 --sparse-allreduce --json "$OUT/syncs.json"
part profile 120 "$PYTHON" -m benchmarks.gpu_profile --graph --json "$OUT/profile.json"
part model-step 240 "$PYTHON" -m benchmarks.model_step --device cuda --rounds 3 --warmup 1
exit "$status"
