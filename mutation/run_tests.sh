#!/usr/bin/env bash
# The tests a mutant must survive: the transforms' tests where the mutant is
# in the JAX backend or the marks for tracers, attnx's fast unit tests (no
# subprocess-heavy CLI, example or pytester runs), the conformance suite on
# NumPy, then the conformance kit's own pytester runs (a minute) where the
# mutant is in the kit.  `run_tests.sh all` (before any mutant) runs them
# all.  Stops at the first failure: a killed mutant.
set -euo pipefail
export OPENBLAS_THREAD_TIMEOUT=4 OMP_NUM_THREADS=1 ATTNX_NUM_THREADS=1 ATTNX_STRICT_PLUGINS=1
if [ "${1:-}" = all ] || [ -n "$(git diff --name-only -- backends/jax_backend.py attnx/_tracing.py)" ]; then
    python -m pytest -x -q -p no:cacheprovider tests/test_tracing.py  # JAX and PyTorch's transforms
fi
python -m pytest -x -q -p no:cacheprovider \
    tests/test_chunk_choice.py tests/test_dispatch.py tests/test_numpy_backend.py tests/test_registry.py \
    tests/test_generic_paths.py tests/test_from_torch.py tests/test_memory.py \
    tests/test_natives.py tests/test_plans.py tests/test_flex.py tests/test_cupy_native.py tests/test_references.py
python -m pytest -x -q -p no:cacheprovider --pyargs attnx_conformance --attnx-backend numpy
if [ "${1:-}" = all ] || [ -n "$(git diff --name-only -- conformance)" ]; then
    python -m pytest -x -q -p no:cacheprovider tests/test_conformance_suite.py
fi
