"""Fit the width of a Nadaraya-Watson regressor by gradient descent (PyTorch backend).

The classic data: y = 2 sin(x) + x^0.8 + noise.  The gaussian kernel with
bandwidth 1/w is softmax(-((q - k) w)^2 / 2); w is learned on leave-one-out
predictions, then the fit and the attention weights are plotted, and a
summary printed: the learned width, the fit's error against the truth.

About 10 s on 2 CPU cores at the default 200 steps.

    python examples/nadaraya_watson_fit.py [--out nadaraya_watson.png]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

# Checked before anything trains: a missing plotting library found only at
# the end would waste the whole run.
_MISSING = [name for name in ("torch", "matplotlib") if importlib.util.find_spec(name) is None]
if _MISSING:
    sys.exit(
        f"this example needs {' and '.join(_MISSING)}: pip install '.[torch,plot]' in attnx's clone "
        "(PyTorch for CPU only: pip install torch --index-url https://download.pytorch.org/whl/cpu)"
    )

import torch  # noqa: E402

import attnx  # noqa: E402


def truth(x: torch.Tensor) -> torch.Tensor:
    return 2 * torch.sin(x) + x**0.8


def make_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training inputs and targets (50 noisy points), and test inputs."""
    gen = torch.Generator().manual_seed(0)
    x_train = torch.sort(torch.rand(50, generator=gen, dtype=torch.float64) * 5).values
    y_train = truth(x_train) + torch.randn(50, generator=gen, dtype=torch.float64) * 0.5
    return x_train, y_train, torch.arange(0, 5, 0.1, dtype=torch.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="nadaraya_watson.png")
    args = parser.parse_args()
    x_train, y_train, x_test = make_data()

    w = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([w], lr=0.5)
    for step in range(args.steps):
        # Leave one out: each training point is predicted from the others.
        keys = x_train.repeat(50, 1)[~torch.eye(50, dtype=torch.bool)].reshape(50, 49)
        values = y_train.repeat(50, 1)[~torch.eye(50, dtype=torch.bool)].reshape(50, 49)
        predictions = torch.stack(
            [attnx.nadaraya_watson(x_train[i : i + 1], keys[i], values[i], bandwidth=1 / w)[0] for i in range(50)]
        )
        loss = ((predictions - y_train) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  leave-one-out MSE {loss.item():.3f}  w {w.item():.2f}")
    with torch.no_grad():
        fit, weights = attnx.nadaraya_watson(x_test, x_train, y_train, bandwidth=1 / w, return_weights=True)
    error = ((fit - truth(x_test)) ** 2).mean().item()
    sharpest = weights.max(-1).values.mean().item()
    print(f"learned w {w.item():.12f} (bandwidth {1 / w.item():.3f})")
    print(f"fit at {len(x_test)} test inputs: mean squared error against the truth {error:.9f}")
    print(f"each test input's largest weight on one training point: {sharpest:.3f} on average")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(x_test, truth(x_test), label="truth")
    left.plot(x_test, fit, label=f"Nadaraya-Watson, learned w = {w.item():.2f}")
    left.plot(x_train, y_train, "o", alpha=0.5, label="training data")
    left.legend()
    attnx.plot.attention_heatmap(weights, ax=right, title="weights: test inputs (rows) on training inputs (columns)")
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
