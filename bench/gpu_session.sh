#!/usr/bin/env bash
# One lent GPU, one call: attnx installed from its wheel, the GPU benchmark,
# then the conformance suite on torch, cupy and jax at once, each on the GPU.
#
# Here, in the repository root (the wheels travel in .whl/, which git ignores):
#     pip wheel --no-deps -w .whl . && pip download --no-deps -d .whl array-api-compat==1.16.0
#     pip download --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 \
#         -d .whl/optional nvidia-cudnn-frontend==1.14.0   # cuDNN's route for float16
# There (PyTorch, CuPy and JAX come with the machine's image):
#     bash bench/gpu_session.sh          # SDPA timed, then the three suites
#     bash bench/gpu_session.sh family   # the family's other operations timed, and SDPA in float16
#     bash bench/gpu_session.sh checks   # bench/gpu_checks.py and tests/test_dask_cupy.py, then the three suites
#     (the stages docs/archive/bench-sessions.md's "For the next lent GPU" lists, in its order: CHECKS="window"
#     for that stage alone; SKIP_DASK=1 to go from the checks to the suites, past the
#     Dask-on-CuPy tests; SKIP_SUITES=1 to stop before the suites; SUITES="cupy jax" for
#     some of them)
# The checks' Dask travels as wheels too:
#     pip download --no-deps -d .whl dask==2026.8.0 partd==1.4.2 locket==1.0.0
# Logs and the benchmark's report go to $OUT; the figures are written up in
# docs/archive/bench-sessions.md ("GPU") and conformance/RESULTS.md.
set -u
OUT=${OUT:-/tmp/attnx-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# Wheels that may not fit this machine's Python (cuDNN's frontend, built per version) are optional.
if ls .whl/optional/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/optional/*.whl || echo "optional wheels not installed"
fi
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
# The frontend looks for libcudnn beside the interpreter's packages; PyTorch's may be elsewhere.
CUDNN_LIB=$(python3 -c "import nvidia.cudnn as c, os; print(os.path.join(list(c.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$CUDNN_LIB" ] && export LD_LIBRARY_PATH=$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# JAX takes 75% of the GPU per process unless told not to, and multiplies
# float32 matrices in TF32 unless told otherwise (conformance/RESULTS.md).
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest
REPO=$PWD
# An empty folder, so the suite is the installed one, as a user runs it.
cd "$(mktemp -d)" || exit 1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    lscpu | grep -E "^Model name|^CPU\(s\)"
    python3 -c "import sys, torch, cupy, jax, numpy; print(sys.version.split()[0], 'torch', torch.__version__, \
'cupy', cupy.__version__, 'jax', jax.__version__, 'numpy', numpy.__version__, jax.devices())"
    python3 -c "import cudnn; print('cudnn frontend', cudnn.__version__, 'backend', cudnn.backend_version())"
    attnx backends
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

bench() {  # the report's name, then attnx bench's arguments
    local name=$1
    shift
    timeout "${BENCH_SECONDS:-110}" attnx bench --backends torch cupy --device cuda:0 --repeat 30 \
        --out "$name" "$@" >>"$OUT/bench.log" 2>&1
    echo "bench $name: exit $? after $((SECONDS - start)) s"
    cp "$name/results.md" "$OUT/$name.md" 2>/dev/null
}

start=$SECONDS
if [ "${1:-}" = family ]; then
    # n = 8192 alone: with 2048 too, the compiles of flex took the H200 past 110 s.
    BENCH_SECONDS=${BENCH_SECONDS:-170} bench bench-family --operations sliding_window multi_head_attention \
        additive_attention --sizes 8192 --baselines torch-flex-compiled
    bench bench-float16 --dtype float16 --sizes 2048 8192 --baselines torch-sdpa
    exit 0
fi

# The GPU to itself while it is timed: the benchmark first, then the suites.
if [ "${1:-}" = checks ]; then
    timeout "${BENCH_SECONDS:-170}" python3 "$REPO/bench/gpu_checks.py" ${CHECKS:-additive} \
        >"$OUT/checks-$(echo ${CHECKS:-additive} | tr ' ' '-').log" 2>&1
    echo "checks: exit $? after $((SECONDS - start)) s"
    if [ -z "${SKIP_DASK:-}" ]; then
    timeout 120 python3 -m pytest "$REPO/tests/test_dask_cupy.py" -rA -p no:cacheprovider --rootdir "$REPO" \
        -c /dev/null >"$OUT/dask-cupy.log" 2>&1
    echo "dask on cupy: exit $? after $((SECONDS - start)) s: $(tail -n 1 "$OUT/dask-cupy.log")"
    # The whole conformance suite on Dask arrays of CuPy chunks.
    timeout "${DASK_SUITE_SECONDS:-180}" attnx conformance dask --device cupy -vv --tb=short -n 8 \
        -p no:cacheprovider >"$OUT/conformance-dask-cupy.log" 2>&1
    echo "conformance dask on cupy: exit $? after $((SECONDS - start)) s: $(tail -n 1 "$OUT/conformance-dask-cupy.log")"
    fi
    [ -n "${SKIP_SUITES:-}" ] && exit 0
else
    # Two runs, so that a run cut short keeps the first's report.
    bench bench-512-2048 --sizes 512 2048 --baselines torch-sdpa jax-sdpa
    bench bench-8192 --sizes 8192 --baselines torch-sdpa jax-sdpa
fi

start=$SECONDS
suite() {  # backend, seconds, workers, then any options for it
    local backend=$1 seconds=$2 workers=$3
    shift 3
    timeout "$seconds" attnx conformance "$backend" "$@" -vv --tb=short -n "$workers" -p no:cacheprovider \
        >"$OUT/conformance-$backend.log" 2>&1
    echo "conformance $backend: exit $? after $((SECONDS - start)) s: $(tail -n 1 "$OUT/conformance-$backend.log")"
}
# 15 of the 16 cores; JAX compiles every case, so it has the most.
SUITES=${SUITES:-torch cupy jax}
case " $SUITES " in *" torch "*) suite torch 200 4 --device cuda:0 & ;; esac
case " $SUITES " in *" cupy "*) suite cupy 200 4 --device cuda:0 & ;; esac
# Dask arrays of CuPy chunks (its wheels in .whl/, as the checks' are).
case " $SUITES " in *" dask "*) suite dask 200 4 --device cupy & ;; esac
# JAX's default device is the GPU where its CUDA plugin is installed.
case " $SUITES " in *" jax "*) suite jax "${JAX_SECONDS:-240}" 7 & ;; esac
wait
