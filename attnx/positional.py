"""Positional encodings: sinusoidal, rotary, learned."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from attnx import _checks, _cotangents, _dispatch, _params
from attnx._typing import Array, Device, DType

__all__ = ["LearnedPositions", "apply_rotary", "apply_rotary_vjp", "learned_positions_vjp", "sinusoidal_positions"]


def _frequencies(xp: Any, half: int, dim: int, base: float, dtype: Any, device: Any) -> Any:
    """``base^(-2j/dim)`` for ``j < half``."""
    exponents = xp.arange(half, dtype=dtype, device=device) * (2.0 / dim)
    return xp.exp(exponents * -math.log(base))


def _creation_dtype(xp: Any, dtype: Any) -> Any:
    if dtype is None:
        return xp.float32
    return getattr(xp, dtype) if isinstance(dtype, str) else dtype


def sinusoidal_positions(
    num_positions: int,
    dim: int,
    *,
    base: float = 10000.0,
    dtype: DType = None,
    backend: str | None = None,
    device: Device = None,
) -> Array:
    r"""The sinusoidal encoding of Vaswani et al. (2017).

    :math:`P_{i, 2j} = \sin(i / \mathrm{base}^{2j/\mathrm{dim}})`,
    :math:`P_{i, 2j+1} = \cos(i / \mathrm{base}^{2j/\mathrm{dim}})`.  An odd
    ``dim`` ends with a sine column.  Row ``i + delta`` is row ``i`` rotated,
    pair by pair, by the angle ``delta * omega_j``: the encoding makes relative
    positions linear.

    Returns
    -------
    array, shape (num_positions, dim)
        float32 by default; computed in float64 where the backend has it.

    Raises
    ------
    TypeError
        If a size is not an integer, or ``dtype`` is not a real floating
        dtype of the backend.
    ValueError
        If a size is negative, or ``base`` is not positive.
    BackendUnavailableError
        If the backend that would run the call cannot run here (its library is
        not installed, or it has no device).

    Parameters
    ----------
    num_positions : int
        Rows: the positions ``0 .. num_positions - 1``.
    dim : int
        Features per position.
    base : float
        The wavelengths' base, 10,000 in the paper.
    dtype : dtype or str, optional
        A real floating dtype of the backend; float32 by default.
    backend : str, optional
        The backend to make the table with; the current one by default.
    device : optional
        A device of that backend, by name (``"cuda:0"``) or the library's own.

    Examples
    --------
    >>> import attnx
    >>> table = attnx.sinusoidal_positions(6, 4)
    >>> table.shape
    (6, 4)
    >>> print(table[:3].round(3))   # sin and cos of position / base^(2i / dim), interleaved
    [[ 0.     1.     0.     1.   ]
     [ 0.841  0.54   0.01   1.   ]
     [ 0.909 -0.416  0.02   1.   ]]
    """
    op = "sinusoidal_positions"
    num_positions = _checks.require_positive_int(op, "num_positions", num_positions, allow_zero=True)
    dim = _checks.require_positive_int(op, "dim", dim)
    _checks.require_size(op, "num_positions x dim", num_positions, dim)
    base = _checks.require_positive_real(op, "base", base)
    chosen, reason, device = _dispatch.resolve_creation(op, backend, device)
    if dtype is not None:
        dtype = _checks.require_dtype_name(op, chosen.xp, chosen.name, dtype, floating=True)
    return _dispatch.call(
        op,
        chosen,
        reason,
        _sinusoidal_generic,
        {"num_positions": num_positions, "dim": dim, "base": base, "dtype": dtype, "device": device},
    )


def _sinusoidal_generic(xp: Any, *, num_positions: int, dim: int, base: float, dtype: Any, device: Any) -> Any:
    dtype = _creation_dtype(xp, dtype)
    compute = _checks.widest_float(xp, device)
    half = (dim + 1) // 2
    angles = xp.arange(num_positions, dtype=compute, device=device)[:, None] * _frequencies(
        xp, half, dim, base, compute, device
    )
    pairs = xp.stack([xp.sin(angles), xp.cos(angles)], axis=-1)
    table = xp.reshape(pairs, (num_positions, 2 * half))[:, :dim]
    return xp.astype(table, dtype)


def apply_rotary(
    x: Array, positions: Array = None, *, base: float = 10000.0, interleaved: bool = True, backend: str | None = None
) -> Array:
    r"""Rotary position embedding (RoPE, Su et al. 2021) of ``x``.

    Each pair of features ``(x_{2j}, x_{2j+1})`` at position ``p`` is rotated
    by the angle ``p * base^(-2j/d)``.  Apply it to queries and keys before
    attention: the score between the rotated query at ``i`` and the rotated
    key at ``j`` then depends on ``i - j`` only.

    Parameters
    ----------
    x : array, shape (..., n, d)
        ``d`` even.
    positions : array, shape (n,) or broadcastable to (..., n), optional
        Integer or real positions; ``0, 1, ..., n-1`` by default.
    base : float
    interleaved : bool
        True (the paper's, RoFormer's and GPT-J's layout): the pairs are
        adjacent features ``(x_{2j}, x_{2j+1})``.  False (GPT-NeoX's and
        LLaMA's in Hugging Face ``transformers``, "rotate_half", flash-attn's
        default): the pairs are ``(x_j, x_{j+d/2})``, at the same angles.
        Weights trained with one layout give other scores with the other.

    Returns
    -------
    array, same shape, dtype and device as ``x``

    Raises
    ------
    TypeError
        If an input is not an array of a registered backend, the inputs come
        from two backends, or ``backend=`` does not own them.
        If ``positions`` is not an integer or real array, or ``interleaved``
        is not ``True`` or ``False``.
    ValueError
        If ``x`` has an odd number of features, or ``positions`` does not
        match its queries (``(..., n)``), or (on concrete values) ``base`` is
        not positive.
        If ``backend=`` names no registered backend, or the inputs lie on
        two different devices.
    BackendUnavailableError
        If the backend that would run the call cannot run here (its library is
        not installed, or it has no device).

    Notes
    -----
    The angles, their cosines and sines are computed in float64 where the
    backend has it (as :func:`sinusoidal_positions`), then rounded to
    ``x``'s dtype: in float32 an angle at position ``10^6`` would be off by
    some 8e-3 rad.

    Examples
    --------
    Rotations keep lengths, and make the dot product of a rotated query and
    key depend on their distance alone:

    >>> import numpy as np
    >>> import attnx
    >>> x = np.random.default_rng(0).standard_normal((1, 4, 8))   # (..., n, d)
    >>> rotated = attnx.apply_rotary(x)                           # positions 0, 1, 2, 3
    >>> bool(np.allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1)))
    True
    >>> q = np.ones((1, 8))
    >>> near = attnx.apply_rotary(q, np.array([2])) @ attnx.apply_rotary(q, np.array([1])).T
    >>> far = attnx.apply_rotary(q, np.array([7])) @ attnx.apply_rotary(q, np.array([6])).T
    >>> bool(np.allclose(near, far))
    True
    """
    op = "apply_rotary"
    chosen, reason = _dispatch.resolve(op, backend, ("x", "positions"), (x, positions), 1)
    xp = chosen.xp
    _checks.require_ndim(op, "x", x, 2, "(..., n, d)")
    _checks.require_float(op, xp, "x", x)
    n, d = x.shape[-2:]
    if d % 2:
        raise ValueError(f"{op}: x must have an even number of features d, got shape {_checks.shape_of(x)}")
    if positions is not None:
        if _checks.dtype_kind(xp, positions) not in ("int", "float"):
            raise TypeError(f"{op}: positions must be integer or real, got dtype {_checks.dtype_name(positions)}")
        if positions.ndim == 0 or positions.shape[-1] != n:
            raise ValueError(
                f"{op}: positions must have shape (..., n) with n = {n}, got {_checks.shape_of(positions)}"
            )
        lead = tuple(x.shape[:-2])
        if _checks.broadcast(op, {"positions": positions.shape[:-1], "x": lead}, _checks.LEADING) != lead:
            raise ValueError(
                f"{op}: positions must broadcast to x's shape (..., n) = {(*lead, n)}, got {_checks.shape_of(positions)}"
            )
    base = _checks.require_positive_real(op, "base", base)
    if interleaved := _checks.require_flag(op, "interleaved", interleaved):
        return _dispatch.call(op, chosen, reason, _rotary_generic, {"x": x, "positions": positions, "base": base})
    if d == 0:  # no feature to rotate
        return x
    # The pairs (x_j, x_{j+d/2}) side by side, rotated by the one rule, and back.
    half = d // 2
    # Where a size is unknown (Dask's, after a selection), gathers: Dask's
    # stack, concat and reshape refuse sizes it doesn't know yet.
    known = _checks.known(*x.shape)
    features = None if known else xp.arange(d, device=_checks.device_of(x))
    if known:
        side_by_side = _interleaved(xp, x[..., :half], x[..., half:])
    else:  # x_0, x_h, x_1, x_h+1, ...
        side_by_side = xp.take(x, features // 2 + (features % 2) * half, axis=-1)
    rotated = _dispatch.call(
        op, chosen, reason, _rotary_generic, {"x": side_by_side, "positions": positions, "base": base}
    )
    if known:
        return xp.concat([rotated[..., 0::2], rotated[..., 1::2]], axis=-1)
    return xp.take(rotated, 2 * (features % half) + features // half, axis=-1)


def _interleaved(xp: Any, first: Any, second: Any) -> Any:
    """``first_0, second_0, first_1, second_1, ...`` on the last axis: a
    stack, not a gather, which is slow on PyTorch (its ``index_select`` along
    the last axis took 17 ms on a (4, 8, 2048, 64) float32 tensor, where a
    stack of its strided halves takes 3 ms and a multiply 1.3 ms)."""
    return xp.reshape(xp.stack([first, second], axis=-1), (*first.shape[:-1], 2 * first.shape[-1]))


def _rotary_generic(xp: Any, *, x: Any, positions: Any, base: float) -> Any:
    n, d = x.shape[-2:]
    if d == 0:  # no feature to rotate
        return x
    device = _checks.device_of(x)
    compute = _checks.accumulation_dtype(xp, x.dtype)
    # The angles in float64 where the backend has it, as sinusoidal_positions'
    # table: in float32, p * base^(-2j/d) is off by p times a rounding of the
    # frequency, 8e-3 rad at p = 10^6.  They are (..., n, d / 2) with the
    # positions' leading axes, not x's: the cost stays small.
    exact = _checks.widest_float(xp, device)
    if positions is None:
        positions = xp.arange(n, dtype=exact, device=device)
    else:
        positions = xp.astype(positions, exact)
    angles = positions[..., None] * _frequencies(xp, d // 2, d, base, exact, device)  # (..., n, d / 2)
    cos, sin = xp.cos(angles), xp.sin(angles)
    if exact != compute:
        cos, sin = xp.astype(cos, compute), xp.astype(sin, compute)
    values = xp.astype(x, compute) if compute != x.dtype else x
    if _checks.known(*x.shape):  # pair j is (x_2j, x_2j+1), turned by its angle
        even, odd = values[..., 0::2], values[..., 1::2]
        rotated = _interleaved(xp, even * cos - odd * sin, odd * cos + even * sin)
    else:
        # Each feature with its partner, by gathers: Dask's stack refuses
        # leading sizes it doesn't know yet.  x_2j cos - x_2j+1 sin; x_2j+1 cos + x_2j sin.
        features = xp.arange(d, device=device)
        cos, sin = xp.take(cos, features // 2, axis=-1), xp.take(sin, features // 2, axis=-1)
        sin = xp.where(features % 2 == 0, -sin, sin)
        rotated = values * cos + xp.take(values, xp.bitwise_xor(features, 1), axis=-1) * sin
    return xp.astype(rotated, x.dtype) if compute != x.dtype else rotated


class LearnedPositions:
    """A learned positional embedding: a ``(num_positions, dim)`` table.

    Initialised standard normal from ``seed`` (as ``torch.nn.Embedding``), the
    same numbers on every backend.  Calling it looks positions up.

    Raises
    ------
    TypeError
        If ``dtype`` is not a real floating dtype of the backend.
    ValueError
        If ``num_positions`` or ``dim`` is not a positive integer, or a
        call asks for more positions than the table holds.

    Parameters
    ----------
    num_positions : int
        Rows of the table: the positions it can look up.
    dim : int
        Features per position.
    seed : int
        Seeds the initial table; the same table on every backend.
    dtype, backend, device : optional
        As :func:`sinusoidal_positions`.

    Attributes
    ----------
    table : array, shape (num_positions, dim)

    Examples
    --------
    >>> import attnx
    >>> positions = attnx.LearnedPositions(16, 4, seed=0)
    >>> positions(3).shape  # the first three rows
    (3, 4)
    """

    def __init__(
        self,
        num_positions: int,
        dim: int,
        *,
        seed: int = 0,
        dtype: DType = None,
        backend: str | None = None,
        device: Device = None,
    ) -> None:
        op = "LearnedPositions"
        num_positions = _checks.require_positive_int(op, "num_positions", num_positions)
        dim = _checks.require_positive_int(op, "dim", dim)
        _checks.require_size(op, "num_positions x dim", num_positions, dim)
        self.table = _params.create(op, backend, seed, dtype, device, normal={"table": (num_positions, dim)})["table"]

    def __call__(self, positions: int | Array) -> Array:
        """Rows for ``positions``: an int ``n`` (rows ``0..n-1``) or an integer
        array of any shape ``(...)``, giving ``(..., dim)``."""
        op, table = "LearnedPositions", self.table
        count = table.shape[0]
        if isinstance(positions, bool):  # an int to Python, not a count
            raise TypeError(f"{op}: positions must be an int n or an integer array, got {positions!r}")
        if isinstance(positions, int):
            if not 0 <= positions <= count:
                raise ValueError(f"{op}: n must lie in [0, {count}], got {positions}")
            return table[:positions, :]
        chosen, _ = _dispatch.resolve(op, None, ("table", "positions"), (table, positions))
        xp = chosen.xp
        if _checks.dtype_kind(xp, positions) != "int":
            raise TypeError(f"{op}: positions must be integers, got dtype {_checks.dtype_name(positions)}")
        # Only concrete positions can be read (not traced or lazy ones).
        if _checks.values_known(positions) and (xp.any(positions < 0) or xp.any(positions >= count)):
            low, high = int(xp.min(positions)), int(xp.max(positions))
            raise ValueError(f"{op}: positions must lie in [0, {count}), got values from {low} to {high}")
        flat = xp.take(table, xp.reshape(positions, (-1,)), axis=0)
        return xp.reshape(flat, (*positions.shape, table.shape[1]))


def apply_rotary_vjp(
    x: Any, positions: Any = None, *, base: float = 10000.0, interleaved: bool = True, backend: str | None = None
) -> tuple[Any, Callable[[Any], dict[str, Any]]]:
    """:func:`attnx.vjp` of :func:`apply_rotary`: the rotated ``x``, and its
    backward.  A rotation's transpose turns back: ``dx`` is the cotangent
    rotated by the negated positions.  Real ``positions`` get theirs too:
    each pair ``(a', b')`` of the output turns by ``d(angle) = g_b a' - g_a
    b'``, times its frequency, summed over the pairs."""
    operation = "vjp(apply_rotary)"
    rotated = apply_rotary(x, positions, base=base, interleaved=interleaved, backend=backend)
    chosen, _ = _dispatch.resolve(operation, backend, ("x", "positions"), (x, positions), 1)
    xp = chosen.xp
    real_positions = positions is not None and _checks.dtype_kind(xp, positions) == "float"

    def backward(cotangent: Any) -> dict[str, Any]:
        _cotangents.require(operation, cotangent, rotated)
        n, d = x.shape[-2:]
        device = _checks.device_of(x)
        exact = _checks.widest_float(xp, device)  # negated exactly, whatever the positions' integer type
        back = -(xp.arange(n, dtype=exact, device=device) if positions is None else xp.astype(positions, exact))
        grads = {"x": apply_rotary(cotangent, back, base=base, interleaved=interleaved, backend=backend)}
        if real_positions and d:
            compute = _checks.accumulation_dtype(xp, x.dtype)
            out, g = (a if a.dtype == compute else xp.astype(a, compute) for a in (rotated, cotangent))
            if interleaved:  # the pairs (2j, 2j + 1), or (j, j + d / 2)
                out_a, out_b, g_a, g_b = out[..., 0::2], out[..., 1::2], g[..., 0::2], g[..., 1::2]
            else:
                half = d // 2
                out_a, out_b, g_a, g_b = out[..., :half], out[..., half:], g[..., :half], g[..., half:]
            turns = g_b * out_a - g_a * out_b  # (..., n, d / 2)
            frequencies = _frequencies(xp, d // 2, d, base, compute, _checks.device_of(x))
            d_positions = xp.sum(turns * frequencies, axis=-1)
            grads["positions"] = _cotangents.like(xp, d_positions, positions)
        return grads

    return rotated, backward


def learned_positions_vjp(embedding: LearnedPositions, positions: Any) -> tuple[Any, Callable[[Any], dict[str, Any]]]:
    """:func:`attnx.vjp` of a :class:`LearnedPositions`' lookup: the rows,
    and a backward that gives the table's cotangent under ``"table"``: each
    row's cotangents summed into the row it was read from (a one-hot
    product, since the array API has no scatter-add)."""
    operation = "vjp(LearnedPositions)"
    rows = embedding(positions)
    table = embedding.table
    xp = _dispatch.resolve(operation, None, ("table",), (table,))[0].xp

    def backward(cotangent: Any) -> dict[str, Any]:
        _cotangents.require(operation, cotangent, rows)
        count, dim = table.shape
        if isinstance(positions, int):  # the first rows, in order
            rest = xp.zeros((count - positions, dim), dtype=table.dtype, device=_checks.device_of(table))
            return {"table": xp.concat([cotangent, rest], axis=0) if count > positions else cotangent}
        flat = xp.reshape(positions, (-1,))
        one_hot = xp.astype(flat[:, None] == xp.arange(count, device=_checks.device_of(table))[None, :], table.dtype)
        return {"table": xp.matrix_transpose(one_hot) @ xp.reshape(cotangent, (-1, dim))}

    return rows, backward
