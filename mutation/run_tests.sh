#!/usr/bin/env bash
# The tests a mutant must survive: the transforms' tests where the mutant is
# in the JAX backend or the marks for tracers, the backwards' tests (on two
# threads a call) and PyTorch's conformance gradients where it is in the
# training code, the layers' tests where it is in a framework layer, JAX's
# loops' tests and conformance where it is in them, attnx's fast unit tests (no
# subprocess-heavy CLI, example or pytester runs), the conformance suite on
# NumPy, then the conformance kit's own pytester runs (a minute) where the
# mutant is in the kit.  `run_tests.sh all` (before any mutant) runs them
# all.  Stops at the first failure: a killed mutant.
set -euo pipefail
export OPENBLAS_THREAD_TIMEOUT=4 OMP_NUM_THREADS=1 ATTNX_NUM_THREADS=1 ATTNX_STRICT_PLUGINS=1
if [ "${1:-}" = all ] || [ -n "$(git diff --name-only -- backends/jax_backend.py attnx/_tracing.py)" ]; then
    python -m pytest -x -q -p no:cacheprovider tests/test_tracing.py  # JAX and PyTorch's transforms
fi
training="backends/numpy_backward.py attnx/_attention_vjp.py attnx/_flex_vjp.py attnx/_dropout.py attnx/_cotangents.py attnx/gradients.py"
if [ "${1:-}" = all ] || [ -n "$(git diff --name-only -- $training)" ]; then
    # The backwards and dropout: first, as they kill most of their mutants, on both cores (cosmic-ray runs one at a time)
    # and on two threads a call, so that the NumPy backward shares its tasks out
    ATTNX_NUM_THREADS=2 python -m pytest -x -q -p no:cacheprovider -n 2 tests/test_vjp.py tests/test_autograd_tiles.py
    ATTNX_NUM_THREADS=2 python -m pytest -x -q -p no:cacheprovider -n 2 --pyargs attnx_conformance --attnx-backend numpy
    # PyTorch's autograd, to which attnx.vjp hands a score_mod of the user's own
    python -m pytest -x -q -p no:cacheprovider --pyargs attnx_conformance --attnx-backend torch -k vjp
fi
layers="attnx/torch.py attnx/flax.py attnx/keras.py backends/torch_function.py"
if [ "${1:-}" = all ] || [ -n "$(git diff --name-only -- $layers)" ]; then
    # The framework layers against PyTorch's, Flax's and Keras's own, and attnx's autograd.Function
    python -m pytest -x -q -p no:cacheprovider -n 2 tests/test_torch_layer.py tests/test_flax_layer.py \
        tests/test_keras_layer.py tests/test_autograd_tiles.py
    python -m pytest -x -q -p no:cacheprovider -n 2 tests/test_vjp.py -k "torch or flax or keras"
fi
if [ "${1:-}" = all ] || [ -n "$(git diff --name-only -- backends/jax_flash.py)" ]; then
    # JAX's loops: their own tests, JAX's backwards and transforms, the JAX conformance suite's attention
    python -m pytest -x -q -p no:cacheprovider -n 2 tests/test_jax_flash.py
    python -m pytest -x -q -p no:cacheprovider -n 2 tests/test_vjp.py tests/test_tracing.py -k jax
    python -m pytest -x -q -p no:cacheprovider -n 2 --pyargs attnx_conformance --attnx-backend jax \
        -k "scaled_dot or flex or vjp"
fi
python -m pytest -x -q -p no:cacheprovider \
    tests/test_chunk_choice.py tests/test_dispatch.py tests/test_numpy_backend.py tests/test_registry.py \
    tests/test_generic_paths.py tests/test_from_torch.py tests/test_memory.py \
    tests/test_natives.py tests/test_plans.py tests/test_flex.py tests/test_cupy_native.py tests/test_references.py
python -m pytest -x -q -p no:cacheprovider --pyargs attnx_conformance --attnx-backend numpy
if [ "${1:-}" = all ] || [ -n "$(git diff --name-only -- conformance)" ]; then
    python -m pytest -x -q -p no:cacheprovider tests/test_conformance_suite.py
fi
