"""Fit the width of a Nadaraya-Watson regressor by gradient descent, on any backend.

The classic data: y = 2 sin(x) + x^0.8 + noise.  The gaussian kernel with
bandwidth 1/w is softmax(-((q - k) w)^2 / 2); w is learned on leave-one-out
predictions, then the fit and the attention weights are plotted, and a
summary printed: the learned width, the fit's error against the truth.

The gradients come from ``attnx.vjp``, so the same loop trains on NumPy
(the default), PyTorch, JAX, CuPy or Dask.  ``--autograd`` trains on
PyTorch with ``loss.backward()`` instead, through attnx's operations, and
reaches the same width.

About 5 s on 2 CPU cores at the default 200 steps on NumPy (10 s with
``--autograd``).  On Dask every operation builds a graph, about 1.5 ms
each at these 50-point sizes, and each step makes some 5,000: a step takes
about 5 s there (``--steps 20`` to watch it learn).

    python examples/nadaraya_watson_fit.py [--backend numpy] [--autograd] [--out nadaraya_watson.png]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import numpy as np

import attnx

POINTS = 50
LEARNING_RATE = 0.5


def truth(x: np.ndarray) -> np.ndarray:
    return 2 * np.sin(x) + x**0.8


def make_data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training inputs and targets (50 noisy points), and test inputs, float64."""
    gen = np.random.default_rng(0)
    x_train = np.sort(gen.random(POINTS) * 5)
    y_train = truth(x_train) + gen.standard_normal(POINTS) * 0.5
    return x_train, y_train, np.arange(0, 5, 0.1)


def leave_one_out(x_train: np.ndarray, y_train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row i: the training inputs and targets other than the i-th, ``(50, 49)`` each."""
    others = ~np.eye(POINTS, dtype=bool)
    return np.tile(x_train, (POINTS, 1))[others].reshape(POINTS, -1), np.tile(y_train, (POINTS, 1))[others].reshape(
        POINTS, -1
    )


def train_with_vjp(backend: str, steps: int) -> float:
    """w after ``steps`` of gradient descent, each gradient pulled back
    through ``attnx.vjp`` on ``backend``'s arrays."""
    x_train, y_train, _ = make_data()
    keys, values = leave_one_out(x_train, y_train)
    try:
        attnx.asarray(0.0, backend=backend, dtype="float64")
        dtype = "float64"
    except TypeError:  # JAX without jax_enable_x64
        dtype = "float32"
    x, y, keys, values = (attnx.asarray(a, backend=backend, dtype=dtype) for a in (x_train, y_train, keys, values))
    w = 1.0
    for step in range(steps):
        bandwidth = attnx.asarray(1 / w, backend=backend, dtype=dtype)
        squares, gradients = [], []
        for i in range(POINTS):  # leave one out: each training point predicted from the others
            prediction, backward = attnx.vjp(
                attnx.nadaraya_watson, x[i : i + 1], keys[i], values[i], bandwidth=bandwidth
            )
            residual = prediction - y[i : i + 1]
            squares.append(residual * residual / POINTS)
            gradients.append(backward(2 * residual / POINTS)["bandwidth"])
        # Summed as the backend's arrays and read once a step: on Dask, one
        # computation of the step's graph rather than one for each point.
        loss = float(attnx.to_numpy(sum(squares[1:], squares[0]))[0])
        d_bandwidth = float(attnx.to_numpy(sum(gradients[1:], gradients[0])))
        w -= LEARNING_RATE * d_bandwidth * (-1 / w**2)  # bandwidth = 1 / w
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:3d}  leave-one-out MSE {loss:.3f}  w {w:.2f}")
    return w


def train_with_autograd(steps: int) -> float:
    """w after ``steps`` of PyTorch's SGD, its gradient from ``loss.backward()``."""
    import torch

    x_train, y_train, _ = (torch.from_numpy(a) for a in make_data())
    keys, values = (torch.from_numpy(a) for a in leave_one_out(x_train.numpy(), y_train.numpy()))
    w = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([w], lr=LEARNING_RATE)
    for step in range(steps):
        predictions = torch.stack(
            [attnx.nadaraya_watson(x_train[i : i + 1], keys[i], values[i], bandwidth=1 / w)[0] for i in range(POINTS)]
        )
        loss = ((predictions - y_train) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:3d}  leave-one-out MSE {loss.item():.3f}  w {w.item():.2f}")
    return w.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="numpy", help="the backend that trains (default: numpy)")
    parser.add_argument("--autograd", action="store_true", help="train on PyTorch with loss.backward()")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="nadaraya_watson.png")
    args = parser.parse_args()
    # Checked before anything trains: a missing library found only at the end would waste the run.
    needed = ["matplotlib"] + (["torch"] if args.autograd else [])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        extras = ",".join(["torch"] * args.autograd + ["plot"])
        sys.exit(f"this example needs {' and '.join(missing)}: pip install '.[{extras}]' in attnx's clone")
    if args.autograd and args.backend != "numpy":
        parser.error("--autograd trains on PyTorch; leave out --backend")
    available = {info.name: info for info in attnx.list_backends()}
    if not args.autograd and (args.backend not in available or not available[args.backend].available):
        reason = available[args.backend].reason if args.backend in available else "not registered"
        parser.error(f"backend {args.backend!r} can't run here: {reason}")
    w = train_with_autograd(args.steps) if args.autograd else train_with_vjp(args.backend, args.steps)

    x_train, y_train, x_test = make_data()
    fit, weights = attnx.nadaraya_watson(x_test, x_train, y_train, bandwidth=1 / w, return_weights=True)
    error = float(((fit - truth(x_test)) ** 2).mean())
    print(f"learned w {w:.12f} (bandwidth {1 / w:.3f})")
    print(f"fit at {len(x_test)} test inputs: mean squared error against the truth {error:.9f}")
    print(f"each test input's largest weight on one training point: {weights.max(-1).mean():.3f} on average")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(x_test, truth(x_test), label="truth")
    left.plot(x_test, fit, label=f"Nadaraya-Watson, learned w = {w:.2f}")
    left.plot(x_train, y_train, "o", alpha=0.5, label="training data")
    left.legend()
    attnx.plot.attention_heatmap(weights, ax=right, title="weights: test inputs (rows) on training inputs (columns)")
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
