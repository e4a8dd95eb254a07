"""Looking at attention weights (needs matplotlib: ``pip install 'attnx[plot]'``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["attention_heatmap"]


def attention_heatmap(
    weights: Any,
    *,
    queries: Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    ax: Any = None,
    title: str | None = None,
    cmap: str = "viridis",
    colorbar: bool = True,
) -> Any:
    """Draw ``weights (n, m)`` (any backend's array) as a heatmap.

    Rows are queries, columns keys; ``queries``/``keys`` label them.
    Returns the matplotlib ``Axes``.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(f"attention_heatmap needs matplotlib: pip install 'attnx[plot]' ({exc})") from exc

    from attnx.conversion import to_numpy

    data = to_numpy(weights)
    if data.ndim != 2:
        raise ValueError(f"attention_heatmap: weights must have shape (n, m), got {tuple(data.shape)}")
    if ax is None:
        _, ax = plt.subplots(figsize=(1 + 0.4 * data.shape[1], 1 + 0.4 * data.shape[0]))
    image = ax.imshow(data, cmap=cmap, vmin=0.0, aspect="auto")
    ax.set_xlabel("keys")
    ax.set_ylabel("queries")
    if keys is not None:
        ax.set_xticks(range(len(keys)), labels=list(keys), rotation=90)
    if queries is not None:
        ax.set_yticks(range(len(queries)), labels=list(queries))
    if title:
        ax.set_title(title)
    if colorbar:
        ax.figure.colorbar(image, ax=ax)
    return ax
