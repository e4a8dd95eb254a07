"""Boolean attention masks, ``True`` where a query may attend a key.

They are built on the current backend (or ``backend=``), combine with ``&``
and feed the ``mask=`` argument of every attention operation.

Examples
--------
>>> import attnx
>>> attnx.masks.causal(3).astype(int)
array([[1, 0, 0],
       [1, 1, 0],
       [1, 1, 1]])
>>> (attnx.masks.causal(4) & attnx.masks.sliding_window(4, window=1)).astype(int)
array([[1, 0, 0, 0],
       [1, 1, 0, 0],
       [0, 1, 1, 0],
       [0, 0, 1, 1]])
"""

from __future__ import annotations

from typing import Any

from attnx import _checks, _dispatch, _masking
from attnx._masking import Align

__all__ = ["causal", "from_lengths", "sliding_window"]


def causal(
    n: int, m: int | None = None, *, align: Align = "bottom_right", backend: str | None = None, device: Any = None
) -> Any:
    """Causal mask of shape ``(n, m)`` (``m`` defaults to ``n``).

    ``align="bottom_right"`` (the default, as ``is_causal=True``): query ``i``
    attends keys ``j <= i + (m - n)``, right for decoding with cached keys.
    ``align="top_left"``: keys ``j <= i``, PyTorch's ``is_causal`` when
    ``n != m``.
    """
    n = _checks.require_positive_int("causal", "n", n, allow_zero=True)
    m = n if m is None else _checks.require_positive_int("causal", "m", m, allow_zero=True)
    _checks.require_size("causal", "n x m", n, m)
    _masking.check_align("causal", align)
    chosen, _, device = _dispatch.resolve_creation("causal", backend, device)
    return _masking.causal(chosen.xp, n, m, align=align, device=device)


def sliding_window(
    n: int,
    m: int | None = None,
    window: int | tuple[int | None, int | None] = 0,
    *,
    align: Align = "bottom_right",
    backend: str | None = None,
    device: Any = None,
) -> Any:
    """Local attention: query ``i`` attends keys within a window around it.

    Parameters
    ----------
    n, m : int
        Queries and keys (``m`` defaults to ``n``).
    window : int, None or (left, right)
        An int ``w`` allows ``w`` keys to the left and none to the right;
        ``(left, right)`` sets both; ``None``, alone or in the pair, means
        unbounded (``window=None`` is the causal mask).  Positions are
        aligned as in :func:`causal`.

    Returns
    -------
    array of bool, shape (n, m)
    """
    operation = "sliding_window"
    n = _checks.require_positive_int(operation, "n", n, allow_zero=True)
    m = n if m is None else _checks.require_positive_int(operation, "m", m, allow_zero=True)
    _checks.require_size(operation, "n x m", n, m)
    left, right = (window, 0) if not isinstance(window, tuple) else window
    if isinstance(window, tuple) and len(window) != 2:
        raise ValueError(f"{operation}: window must be an int or a (left, right) pair, got {window!r}")
    left = None if left is None else _checks.require_positive_int(operation, "window (left)", left, allow_zero=True)
    right = None if right is None else _checks.require_positive_int(operation, "window (right)", right, allow_zero=True)
    _masking.check_align(operation, align)
    chosen, _, device = _dispatch.resolve_creation(operation, backend, device)
    return _masking.window(chosen.xp, n, m, left, right, align=align, device=device)


def from_lengths(lengths: Any, m: int, *, backend: str | None = None) -> Any:
    """Padding mask: ``mask[..., j] = j < lengths[...]``, shape ``(*lengths.shape, m)``.

    Add a query axis to use it as an attention mask:
    ``mask=attnx.masks.from_lengths(lengths, m)[..., None, :]``.
    """
    operation = "from_lengths"
    chosen, _ = _dispatch.resolve(operation, backend, ("lengths",), (lengths,), 1)
    xp = chosen.xp
    m = _checks.require_positive_int(operation, "m", m, allow_zero=True)
    _masking.check_lengths(operation, xp, lengths, _checks.shape_of(lengths), 1, m)
    positions = xp.arange(m, dtype=lengths.dtype, device=_checks.device_of(lengths))
    return positions < lengths[..., None]
