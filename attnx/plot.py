"""Looking at attention weights (needs matplotlib: ``pip install '.[plot]'`` from a clone)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from attnx import _checks
from attnx._typing import Array

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn, not with attnx
    import matplotlib.axes

__all__ = ["attention_heatmap", "block_mask"]


def attention_heatmap(
    weights: Array,
    *,
    queries: Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    ax: matplotlib.axes.Axes | None = None,
    title: str | None = None,
    cmap: str = "viridis",
    colorbar: bool = True,
) -> matplotlib.axes.Axes:
    """Draw ``weights (n, m)`` (any backend's array) as a heatmap.

    Rows are queries, columns keys; ``queries``/``keys`` label them.  Without
    ``ax``, a new figure gives each weight 0.4 inch and the labels an inch.
    Returns the matplotlib ``Axes``.

    Parameters
    ----------
    weights : array, shape (n, m)
        Attention weights of any backend (copied to the host).
    queries, keys : sequence of str, optional
        Labels of the rows and columns.
    ax : matplotlib Axes, optional
        Where to draw; a new figure by default.
    title : str, optional
    cmap : str
        A matplotlib colour map.
    colorbar : bool
        Draw a colour bar beside the heatmap.

    Returns
    -------
    matplotlib.axes.Axes

    Raises
    ------
    ImportError
        If matplotlib is not installed (``pip install '.[plot]'``).
    ValueError
        If ``weights`` is not 2-dimensional, or a list of labels has another
        length.

    Examples
    --------
    >>> import numpy as np
    >>> import attnx
    >>> weights = attnx.masked_softmax(np.zeros((3, 3)), mask=attnx.masks.causal(3))
    >>> ax = attnx.plot.attention_heatmap(weights, queries=["a", "b", "c"], keys=["a", "b", "c"], title="causal")
    >>> ax.get_title(), [label.get_text() for label in ax.get_xticklabels()]
    ('causal', ['a', 'b', 'c'])
    """
    plt = _pyplot("attention_heatmap")

    from attnx.conversion import to_numpy

    data = to_numpy(weights)
    if data.ndim != 2:
        raise ValueError(f"attention_heatmap: weights must have shape (n, m), got {tuple(data.shape)}")
    for name, labels, size, axis in (
        ("queries", queries, data.shape[0], "row"),
        ("keys", keys, data.shape[1], "column"),
    ):
        if labels is not None and (isinstance(labels, str) or len(labels) != size):
            got = repr(labels) if isinstance(labels, str) else f"{len(labels)} labels"
            raise ValueError(f"attention_heatmap: {name} must be {size} labels, one per {axis} of weights, got {got}")
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


def block_mask(
    mask: Array, *, batch: int = 0, head: int = 0, ax: matplotlib.axes.Axes | None = None, title: str | None = None
) -> matplotlib.axes.Axes:
    """Draw a :class:`attnx.BlockMask`'s blocks for one batch entry and head:
    empty blocks (skipped) white, partial blocks (masked) light, full
    blocks dark, each drawn at its place and size in the scores.  Without
    ``ax``, a new figure 6 inches wide, as tall as the scores' shape makes it.
    Returns the matplotlib ``Axes``.

    Parameters
    ----------
    mask : BlockMask
        From :func:`attnx.create_block_mask`.
    batch, head : int
        Which batch entry and head to draw, where the mask has several.
    ax : matplotlib Axes, optional
        Where to draw; a new figure by default.
    title : str, optional

    Returns
    -------
    matplotlib.axes.Axes

    Raises
    ------
    ImportError
        If matplotlib is not installed (``pip install '.[plot]'``).
    TypeError
        If ``mask`` is not a :class:`attnx.BlockMask`.
    ValueError
        If ``batch`` or ``head`` is out of the block mask's range.

    Examples
    --------
    >>> import attnx
    >>> from attnx import mods
    >>> window = attnx.create_block_mask(mods.sliding_window(256), None, None, 2048, 2048)
    >>> ax = attnx.plot.block_mask(window)
    >>> ax.get_xlabel(), ax.get_ylabel()
    ('keys', 'queries')
    """
    from attnx.conversion import to_numpy
    from attnx.flex import BlockMask

    plt = _pyplot("block_mask")
    if not isinstance(mask, BlockMask):
        raise TypeError(f"block_mask: mask must be an attnx.BlockMask, got {type(mask).__name__}")
    kinds = to_numpy(mask.kinds)
    for name, index, size in (("batch", batch, mask.shape[0] or 1), ("head", head, mask.shape[1] or 1)):
        index = _checks.require_int("block_mask", name, index)
        if not 0 <= index < size:
            raise ValueError(f"block_mask: {name} must lie in [0, {size}), got {index}")
    kinds = kinds[min(batch, kinds.shape[0] - 1), min(head, kinds.shape[1] - 1)]  # size 1: the same for all
    (q_block, kv_block), (n, m) = mask.block_size, mask.shape[2:]
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 6 * n / max(m, 1)))
    from matplotlib.colors import ListedColormap

    colours = ListedColormap(["white", "#9ecae1", "#08519c"])
    ax.imshow(
        kinds,
        cmap=colours,
        vmin=0,
        vmax=2,
        interpolation="nearest",
        extent=(0, kinds.shape[1] * kv_block, kinds.shape[0] * q_block, 0),
    )
    ax.set_xlim(0, m)
    ax.set_ylim(n, 0)
    ax.set_xlabel("keys")
    ax.set_ylabel("queries")
    sparsity = mask.sparsity
    said = "" if sparsity is None else f", {sparsity:.0%} of blocks skipped"
    ax.set_title(title or f"blocks of {q_block} x {kv_block}: empty, partial, full{said}")
    return ax


def _pyplot(function: str) -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(f"{function} needs matplotlib: pip install '.[plot]' in attnx's clone ({exc})") from exc
    return plt
