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

from attnx import _checks, _dispatch, _masking
from attnx._masking import Align
from attnx._typing import Array, Device

__all__ = ["causal", "from_lengths", "sliding_window"]


def causal(
    n: int, m: int | None = None, *, align: Align = "bottom_right", backend: str | None = None, device: Device = None
) -> Array:
    """Causal mask of shape ``(n, m)`` (``m`` defaults to ``n``).

    ``align="bottom_right"`` (the default, as ``is_causal=True``): query ``i``
    attends keys ``j <= i + (m - n)``, right for decoding with cached keys.
    ``align="top_left"``: keys ``j <= i``, PyTorch's ``is_causal`` when
    ``n != m``.

    Raises
    ------
    TypeError
        If a size is not an integer.
    ValueError
        If a size is negative or ``align`` is neither ``"bottom_right"``
        nor ``"top_left"``.
    BackendUnavailableError
        If the backend that would run the call cannot run here (its library is
        not installed, or it has no device).

    Parameters
    ----------
    n : int
        Queries.
    m : int, optional
        Keys; ``n`` by default.
    align : {"bottom_right", "top_left"}
        Where the diagonal starts.
    backend : str, optional
        The backend to make the mask with; the current one by default.
    device : optional
        A device of that backend.

    Returns
    -------
    array of bool, shape (n, m)
        ``True`` where the query may attend the key.

    Examples
    --------
    >>> from attnx import masks
    >>> print(masks.causal(2, 4).astype(int))                     # aligned to the end (attnx's is_causal)
    [[1 1 1 0]
     [1 1 1 1]]
    >>> print(masks.causal(2, 4, align="top_left").astype(int))   # PyTorch's is_causal
    [[1 0 0 0]
     [1 1 0 0]]
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
    device: Device = None,
) -> Array:
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

    Raises
    ------
    TypeError
        If a size is not an integer.
    ValueError
        If a size or a side of ``window`` is negative, or ``align`` is
        neither ``"bottom_right"`` nor ``"top_left"``.
    BackendUnavailableError
        If the backend that would run the call cannot run here (its library is
        not installed, or it has no device).

    Examples
    --------
    >>> from attnx import masks
    >>> print(masks.sliding_window(4, window=1).astype(int))        # itself and one key back
    [[1 0 0 0]
     [1 1 0 0]
     [0 1 1 0]
     [0 0 1 1]]
    >>> print(masks.sliding_window(4, window=(1, 1)).astype(int))   # one on each side
    [[1 1 0 0]
     [1 1 1 0]
     [0 1 1 1]
     [0 0 1 1]]
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


def from_lengths(lengths: Array, m: int, *, backend: str | None = None) -> Array:
    """Padding mask: ``mask[..., j] = j < lengths[...]``, shape ``(*lengths.shape, m)``.

    Add a query axis to use it as an attention mask:
    ``mask=attnx.masks.from_lengths(lengths, m)[..., None, :]``.

    Raises
    ------
    TypeError
        If an input is not an array of a registered backend, the inputs come
        from two backends, or ``backend=`` does not own them.
        If ``lengths`` is not an integer array of a registered backend.
    ValueError
        If ``m`` is negative, or (on concrete values) a length lies outside
        ``[0, m]``.
        If ``backend=`` names no registered backend, or the inputs lie on
        two different devices.
    BackendUnavailableError
        If the backend that would run the call cannot run here (its library is
        not installed, or it has no device).

    Parameters
    ----------
    lengths : integer array, shape (...)
        Keys each row may attend; the rest are padding.
    m : int
        Keys.
    backend : str, optional
        The backend of ``lengths``; found from it by default.

    Returns
    -------
    array of bool, shape (..., m)

    Examples
    --------
    >>> import numpy as np
    >>> from attnx import masks
    >>> print(masks.from_lengths(np.array([3, 1]), 4))
    [[ True  True  True False]
     [ True False False False]]
    """
    operation = "from_lengths"
    chosen, _ = _dispatch.resolve(operation, backend, ("lengths",), (lengths,), 1)
    xp = chosen.xp
    m = _checks.require_positive_int(operation, "m", m, allow_zero=True)
    _masking.check_lengths(operation, xp, lengths, _checks.shape_of(lengths), 1, m)
    positions = xp.arange(m, dtype=lengths.dtype, device=_checks.device_of(lengths))
    return positions < lengths[..., None]
