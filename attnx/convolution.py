"""Dilated causal 1-D convolution (WaveNet) and its receptive field."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from attnx import _checks, _cotangents, _dispatch
from attnx._typing import Array

__all__ = ["causal_conv1d", "causal_conv1d_vjp", "receptive_field"]

_CONV = "causal_conv1d"


def causal_conv1d(
    x: Array, weight: Array, bias: Array = None, *, stride: int = 1, dilation: int = 1, backend: str | None = None
) -> Array:
    """Dilated causal 1-D convolution (cross-correlation, as PyTorch's).

    The input is left-padded with ``(kernel_size - 1) * dilation`` zeros, so
    output ``t`` sees only inputs up to ``t * stride``.  Equals
    ``torch.nn.functional.conv1d`` on the left-padded input.

    Parameters
    ----------
    x : array, shape (..., c_in, length)
    weight : array, shape (c_out, c_in, kernel_size)
        PyTorch's layout.
    bias : array, shape (c_out,), optional
    stride, dilation : int

    Returns
    -------
    array, shape (..., c_out, ceil(length / stride))

    Raises
    ------
    TypeError
        If an input is not an array of a registered backend, the inputs come
        from two backends, or ``backend=`` does not own them.
        If ``weight`` or ``bias`` is of another backend or dtype, or
        ``stride`` or ``dilation`` is not an integer.
    ValueError
        If ``weight`` is not ``(c_out, c_in, kernel_size)``, ``x`` is not
        ``(..., c_in, length)``, ``bias`` is not ``(c_out,)``, or ``stride`` or
        ``dilation`` is not positive.
        If ``backend=`` names no registered backend, or the inputs lie on
        two different devices.
    BackendUnavailableError
        If the backend that would run the call cannot run here (its library is
        not installed, or it has no device).

    Examples
    --------
    Each output sees only the present and the past; with ``dilation`` the
    kernel's taps lie ``dilation`` steps apart:

    >>> import numpy as np
    >>> import attnx
    >>> x = np.arange(8.0).reshape(1, 1, 8)              # (batch, c_in, length)
    >>> weight = np.array([[[1.0, 0.0, 0.0]]])          # takes x[t - 2 * dilation]
    >>> print(attnx.causal_conv1d(x, weight, dilation=2))
    [[[0. 0. 0. 0. 0. 1. 2. 3.]]]
    >>> attnx.receptive_field(2, [1, 2, 4, 8])           # WaveNet's stack of 4
    16
    """
    chosen, reason = _dispatch.resolve(_CONV, backend, ("x", "weight", "bias"), (x, weight, bias), 2)
    xp = chosen.xp
    _checks.require_ndim(_CONV, "x", x, 2, "(..., c_in, length)")
    if weight.ndim != 3:
        raise ValueError(f"{_CONV}: weight must have shape (c_out, c_in, kernel_size), got {_checks.shape_of(weight)}")
    names = ("x", "weight") + (("bias",) if bias is not None else ())
    arrays = (x, weight) + ((bias,) if bias is not None else ())
    for name, array in zip(names, arrays):
        _checks.require_float(_CONV, xp, name, array)
    _checks.require_same_dtype(_CONV, names, arrays)
    c_out, c_in, kernel_size = weight.shape
    if kernel_size == 0:
        raise ValueError(f"{_CONV}: weight must have a kernel_size of at least 1, got shape {_checks.shape_of(weight)}")
    _checks.require_known(_CONV, "the output length", {"x": x}, axes=(-1,))
    if x.shape[-2] != c_in:
        raise ValueError(
            f"{_CONV}: x must have shape (..., c_in, length) with c_in = {c_in} (from weight), got {_checks.shape_of(x)}"
        )
    if bias is not None and _checks.shape_of(bias) != (c_out,):
        raise ValueError(f"{_CONV}: bias must have shape (c_out,) = ({c_out},), got {_checks.shape_of(bias)}")
    stride = _checks.require_positive_int(_CONV, "stride", stride)
    dilation = _checks.require_positive_int(_CONV, "dilation", dilation)
    return _dispatch.call(
        _CONV,
        chosen,
        reason,
        _causal_conv1d_generic,
        {"x": x, "weight": weight, "bias": bias, "stride": stride, "dilation": dilation},
    )


def _causal_conv1d_generic(xp: Any, *, x: Any, weight: Any, bias: Any, stride: int, dilation: int) -> Any:
    kernel_size = weight.shape[-1]
    length = x.shape[-1]
    out_length = -(-length // stride)
    # A tap that looks back ``shift >= length`` positions sees only the zero
    # padding: it is skipped, so the padding never exceeds the input (a huge
    # dilation costs nothing).
    pad = min((kernel_size - 1) * dilation, max(length - 1, 0))
    if pad:
        zeros = xp.zeros((*x.shape[:-1], pad), dtype=x.dtype, device=_checks.device_of(x))
        x = xp.concat([zeros, x], axis=-1)
    span = stride * (out_length - 1) + 1
    output = None
    # One matrix product per tap: (c_out, c_in) @ (..., c_in, out_length).
    for tap in range(kernel_size):
        shift = (kernel_size - 1 - tap) * dilation
        if length == 0 or shift > pad:
            continue
        start = pad - shift
        term = weight[:, :, tap] @ x[..., start : start + span : stride]
        output = term if output is None else output + term
    if output is None:  # no input, or every tap beyond it
        shape = (*x.shape[:-2], weight.shape[0], out_length)
        output = xp.zeros(shape, dtype=x.dtype, device=_checks.device_of(x))
    if bias is not None:
        output = output + bias[:, None]
    return output


def receptive_field(kernel_size: int | Sequence[int], dilations: Sequence[int]) -> int:
    """Receptive field of a stack of dilated causal convolutions.

    ``1 + sum_l (kernel_size_l - 1) * dilation_l``: how many consecutive
    inputs one output depends on.

    Raises
    ------
    ValueError
        If ``kernel_size`` or a dilation is not a positive integer.

    Parameters
    ----------
    kernel_size : int or sequence of int
        The kernel size of every layer, or one per layer.
    dilations : sequence of int
        The dilation of each layer.

    Returns
    -------
    int

    Examples
    --------
    >>> receptive_field(2, [1, 2, 4, 8])  # WaveNet's doubling dilations
    16
    """
    op = "receptive_field"
    if not isinstance(dilations, (list, tuple)):
        raise TypeError(f"{op}: dilations must be a list of positive integers, got {type(dilations).__name__}")
    dilations = [_checks.require_positive_int(op, f"dilations[{i}]", d) for i, d in enumerate(dilations)]
    if isinstance(kernel_size, (list, tuple)):
        if len(kernel_size) != len(dilations):
            raise ValueError(
                f"{op}: kernel_size must be an int or one per layer ({len(dilations)}), got {len(kernel_size)}"
            )
        sizes = [_checks.require_positive_int(op, f"kernel_size[{i}]", k) for i, k in enumerate(kernel_size)]
    else:
        sizes = [_checks.require_positive_int(op, "kernel_size", kernel_size)] * len(dilations)
    return 1 + sum((k - 1) * d for k, d in zip(sizes, dilations))


def causal_conv1d_vjp(
    x: Any, weight: Any, bias: Any = None, *, stride: int = 1, dilation: int = 1, backend: str | None = None
) -> tuple[Any, Callable[[Any], dict[str, Any]]]:
    """:func:`attnx.vjp` of :func:`causal_conv1d`: its output, and its
    backward, a tap at a time as the forward.

    With the input left-padded as the forward pads it, tap ``k`` reads
    ``x_pad[..., start_k + t * stride]``: its weight's gradient is the
    cotangent times those inputs, summed over the leading axes, and the
    input's is ``weight[:, :, k]^T`` times the cotangent, put back at those
    positions (spread ``stride`` apart by interleaved zeros, no scatter)."""
    operation = f"vjp({_CONV})"
    output = causal_conv1d(x, weight, bias, stride=stride, dilation=dilation, backend=backend)
    chosen, _ = _dispatch.resolve(operation, backend, ("x", "weight", "bias"), (x, weight, bias), 2)
    xp = chosen.xp

    def backward(cotangent: Any) -> dict[str, Any]:
        _cotangents.require(operation, cotangent, output)
        kernel_size, length, out_length = weight.shape[-1], x.shape[-1], cotangent.shape[-1]
        pad = min((kernel_size - 1) * dilation, max(length - 1, 0))  # the forward's padding
        padded = x
        device = _checks.device_of(x)
        if pad:
            padded = xp.concat([xp.zeros((*x.shape[:-1], pad), dtype=x.dtype, device=device), x], axis=-1)
        span = stride * (out_length - 1) + 1
        leading = tuple(range(x.ndim - 2))
        d_padded = xp.zeros_like(padded)
        d_taps = []
        for tap in range(kernel_size):
            shift = (kernel_size - 1 - tap) * dilation
            if length == 0 or shift > pad:  # a tap the forward skipped: it saw only zeros
                d_taps.append(xp.zeros_like(weight[:, :, tap]))
                continue
            start = pad - shift
            inputs = padded[..., start : start + span : stride]  # (..., c_in, out_length)
            d_tap = cotangent @ xp.matrix_transpose(inputs)  # (..., c_out, c_in)
            d_taps.append(xp.sum(d_tap, axis=leading) if leading else d_tap)
            spread = xp.matrix_transpose(weight[:, :, tap]) @ cotangent  # (..., c_in, out_length)
            if stride > 1:  # out_length values, stride apart: each followed by stride - 1 zeros
                gaps = xp.zeros((*spread.shape, stride - 1), dtype=spread.dtype, device=device)
                spread = xp.reshape(xp.concat([spread[..., None], gaps], axis=-1), (*spread.shape[:-1], -1))
                spread = spread[..., :span]
            after = padded.shape[-1] - start - span
            parts = [spread]
            if start:
                parts.insert(0, xp.zeros((*spread.shape[:-1], start), dtype=spread.dtype, device=device))
            if after:
                parts.append(xp.zeros((*spread.shape[:-1], after), dtype=spread.dtype, device=device))
            d_padded = d_padded + (xp.concat(parts, axis=-1) if len(parts) > 1 else spread)
        grads = {"x": d_padded[..., pad:] if pad else d_padded, "weight": xp.stack(d_taps, axis=-1)}
        if bias is not None:
            grads["bias"] = xp.sum(cotangent, axis=(*leading, cotangent.ndim - 1))
        return grads

    return output, backward
