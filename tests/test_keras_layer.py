"""attnx.keras.MultiHeadAttention against keras.layers.MultiHeadAttention on
Keras' JAX and PyTorch backends: each backend in a process of its own
(Keras picks its backend once, at import), running tests/keras_checks.py:
the same weights, outputs, scores and weight gradients, the masks Keras
makes, get_config/from_config and a saved model, attnx's dropout, and a
model that trains with model.fit as Keras' layer does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = Path(__file__).with_name("keras_checks.py")


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_the_layer_equals_keras_s_on_its_backend(backend):
    pytest.importorskip(backend)
    done = subprocess.run(
        [sys.executable, str(CHECKS)],
        env={**os.environ, "KERAS_BACKEND": backend},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert f"all checks passed on Keras' {backend} backend" in done.stderr


def test_import_attnx_does_not_import_keras():
    code = "import sys, attnx; assert 'keras' not in sys.modules; import attnx.keras; assert 'keras' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "KERAS_BACKEND": "jax"})
