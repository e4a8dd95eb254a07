"""Multi-head attention: functional, parameter initialisation, and a module."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from attnx import _checks, _cotangents, _dispatch, _dropout, _masking, _params
from attnx._attention_vjp import scaled_dot_product_attention_vjp
from attnx._typing import Array, Device, DType
from attnx.attention import scaled_dot_product_attention

__all__ = ["MultiHeadAttention", "init_multi_head_params", "multi_head_attention"]

_MHA = "multi_head_attention"
_WEIGHTS = ("w_q", "w_k", "w_v", "w_o")
_BIASES = ("b_q", "b_k", "b_v", "b_o")
#: One learned key/value position appended after the projections (PyTorch's add_bias_kv).
_EXTRA_KV = ("bias_k", "bias_v")


def multi_head_attention(
    query: Array,
    key: Array,
    value: Array,
    params: Mapping[str, Any],
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    mask: Array = None,
    key_lengths: Array = None,
    is_causal: bool = False,
    return_weights: bool = False,
    average_weights: bool = True,
    add_zero_attn: bool = False,
    chunk_size: int | tuple[int, int] | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | Array | None = None,
    backend: str | None = None,
) -> Array:
    """Multi-head attention (Vaswani et al. 2017), with grouped-query heads.

    Each head ``i`` computes scaled dot-product attention of the projected
    ``query @ w_q`` against ``key @ w_k`` and ``value @ w_v``; the heads are
    concatenated and projected by ``w_o``.

    Parameters
    ----------
    query : array, shape (..., n, d_query)
    key : array, shape (..., m, d_key)
    value : array, shape (..., m, d_value)
        Self-attention passes the same array three times; cross-attention
        passes the encoder's states as ``key`` and ``value``.
    params : mapping of str to array
        ``w_q (d_query, h*d_k)``, ``w_k (d_key, h_kv*d_k)``,
        ``w_v (d_value, h_kv*d_v)``, ``w_o (h*d_v, d_model)`` and optional
        biases ``b_q (h*d_k,)``, ``b_k``, ``b_v``, ``b_o (d_model,)``.  Without
        ``w_o`` there is no output projection and the concatenated heads
        ``(..., n, h*d_v)`` are returned: with ``num_heads=1`` that is the
        single-head self-attention with query/key/value projections.
        ``bias_k (h_kv*d_k,)`` with ``bias_v (h_kv*d_v,)``: one more key and
        value, appended after the projections (PyTorch's ``add_bias_kv``).
    num_heads : int
        ``h``, the number of query heads; ``d_k`` and ``d_v`` are read off the
        weights' widths.
    num_kv_heads : int, optional
        ``h_kv``, dividing ``h``: grouped-query (``1``: multi-query)
        attention.  Query head ``i`` uses key/value head ``i // (h // h_kv)``,
        as PyTorch's ``enable_gqa``.  Defaults to ``h``.
    mask : array, optional
        Broadcastable to ``(..., n, m)``, or per head ``(..., h, n, m)`` (with
        every leading dimension written out).  Boolean ``True`` = attend, or
        additive, as in :func:`attnx.scaled_dot_product_attention`.
    key_lengths, is_causal :
        As in :func:`attnx.scaled_dot_product_attention`.
    return_weights : bool
        Also return the attention weights.
    average_weights : bool
        Weights averaged over heads ``(..., n, m)``, or per head
        ``(..., h, n, m)`` when False.
    add_zero_attn : bool
        Append a key and a value of zeros to every head, after ``bias_k``
        (PyTorch's ``add_zero_attn``).  Keys appended by ``bias_k`` and
        ``add_zero_attn`` are attended by every query: masks, ``key_lengths``
        and ``is_causal`` apply to the ``m`` given keys, and the weights have
        ``m + 1`` or ``m + 2`` columns.
    chunk_size :
        As in :func:`attnx.scaled_dot_product_attention` (memory-efficient
        attention; chosen automatically over the memory budget).
    dropout_p, dropout_seed :
        Dropout on the heads' weights, as in
        :func:`attnx.scaled_dot_product_attention` (PyTorch's ``dropout``;
        the returned weights are those after dropout, as PyTorch's are).

    Returns
    -------
    output : array, shape (..., n, d_model)
    weights : array, shape (..., n, m) or (..., h, n, m)
        Only with ``return_weights=True``.

    Raises
    ------
    TypeError
        If an input is not an array of a registered backend, the inputs come
        from two backends, or ``backend=`` does not own them.
        If ``params`` is not a mapping of arrays of the inputs' backend and
        dtype, or a flag is not ``True`` or ``False``.
    ValueError
        If ``params`` lacks ``w_q``, ``w_k`` or ``w_v`` or holds one of another
        shape, ``num_heads`` does not divide the projections' width,
        ``num_kv_heads`` does not divide ``num_heads``, the inputs' feature
        sizes disagree with the weights, a mask or ``key_lengths`` has
        another shape, or ``dropout_p`` lies outside ``[0, 1]`` or comes
        without a ``dropout_seed`` (as in :func:`scaled_dot_product_attention`).
        If ``backend=`` names no registered backend, or the inputs lie on
        two different devices.
    BackendUnavailableError
        If the backend that would run the call cannot run here (its library is
        not installed, or it has no device).

    Examples
    --------
    >>> import numpy as np
    >>> import attnx
    >>> params = attnx.init_multi_head_params(16, 4, num_kv_heads=2, seed=0, dtype="float64")
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 16))   # (batch, n, d_model)
    >>> out, weights = attnx.multi_head_attention(x, x, x, params, num_heads=4, num_kv_heads=2,
    ...                                           is_causal=True, return_weights=True)
    >>> out.shape, weights.shape   # weights averaged over heads, as PyTorch's
    ((2, 5, 16), (2, 5, 5))
    >>> attnx.multi_head_attention(x, x, x, params, num_heads=3, num_kv_heads=2)
    Traceback (most recent call last):
        ...
    ValueError: multi_head_attention: num_kv_heads must divide num_heads = 3, got 2
    """
    entries = _WEIGHTS + _BIASES + _EXTRA_KV
    arrays = (
        (query, key, value, mask, key_lengths, *(params.get(p) for p in entries))
        if isinstance(params, Mapping)
        else (query,)
    )
    names = ("query", "key", "value", "mask", "key_lengths", *(f"params[{p!r}]" for p in entries))
    if isinstance(params, Mapping):
        names, arrays = (*names, "dropout_seed"), (*arrays, _dropout.seed_array(dropout_seed))
    chosen, reason = _dispatch.resolve(_MHA, backend, names, arrays, 3)
    xp = chosen.xp
    if dropout_p or dropout_seed is not None:
        dropout_p = _dropout.require_dropout(_MHA, xp, dropout_p, dropout_seed, chosen.owns)
    for flag, setting in (
        ("is_causal", is_causal),
        ("return_weights", return_weights),
        ("average_weights", average_weights),
        ("add_zero_attn", add_zero_attn),
    ):
        _checks.require_flag(_MHA, flag, setting)
    layout = check_multi_head(xp, query, key, value, params, num_heads, num_kv_heads)
    batch_shape = _checks.leading_shape(query, key, value, _MHA)
    n, m = query.shape[-2], key.shape[-2]
    per_head = mask is not None and mask.ndim == len(batch_shape) + 3
    mask_batch_shape = (*batch_shape, num_heads) if per_head else batch_shape
    _masking.check_masks(
        _MHA, xp, mask, key_lengths, batch_shape, n, m, scores_dtype=query.dtype, mask_batch_shape=mask_batch_shape
    )
    arguments = {
        "query": query,
        "key": key,
        "value": value,
        "params": params,
        "layout": layout,
        "mask": mask,
        "mask_per_head": per_head,
        "key_lengths": key_lengths,
        "is_causal": is_causal,
        "return_weights": return_weights,
        "average_weights": average_weights,
        "add_zero_attn": add_zero_attn,
        "chunk_size": chunk_size,
    }
    if not dropout_p:
        return _dispatch.call(_MHA, chosen, reason, _multi_head_generic, arguments)
    options = {"dropout_p": dropout_p, "dropout_seed": dropout_seed}
    return _dispatch.call(_MHA, chosen, reason, _multi_head_generic, arguments, options, generic_for="dropout")


def check_multi_head(
    xp: Any, query: Any, key: Any, value: Any, params: Mapping[str, Any], num_heads: int, num_kv_heads: int | None
) -> dict[str, int]:
    """Validate inputs and params; returns the sizes ``h, h_kv, d_k, d_v``."""
    h = _checks.require_positive_int(_MHA, "num_heads", num_heads)
    h_kv = h if num_kv_heads is None else _checks.require_positive_int(_MHA, "num_kv_heads", num_kv_heads)
    if h % h_kv:
        raise ValueError(f"{_MHA}: num_kv_heads must divide num_heads = {h}, got {h_kv}")
    layouts = ("(..., n, d_query)", "(..., m, d_key)", "(..., m, d_value)")
    _checks.require_query_key_value(_MHA, xp, query, key, value, layouts)
    _params.require_mapping(_MHA, params, required=("w_q", "w_k", "w_v"), optional=("w_o", *_BIASES, *_EXTRA_KV))
    w_q = _params.matrix(_MHA, xp, params, "w_q", rows=query.shape[-1], rows_name="d_query", dtype=query.dtype)
    if w_q.shape[1] % h:
        raise ValueError(
            f"{_MHA}: params['w_q'] must have h*d_k columns with h = {h}, got shape {_checks.shape_of(w_q)}"
        )
    d_k = w_q.shape[1] // h
    w_k = _params.matrix(_MHA, xp, params, "w_k", rows=key.shape[-1], rows_name="d_key", dtype=query.dtype)
    if w_k.shape[1] != h_kv * d_k:
        # Either may be the wrong one: name both, with what each implies.
        implied = f"d_k = {w_k.shape[1] / h_kv:g}" if w_k.shape[1] % h_kv else f"d_k = {w_k.shape[1] // h_kv}"
        raise ValueError(
            f"{_MHA}: params['w_q'] and params['w_k'] disagree on d_k: params['w_q'] has shape "
            f"{_checks.shape_of(w_q)}, h*d_k with h = {h} gives d_k = {d_k}, but params['w_k'] has shape "
            f"{_checks.shape_of(w_k)}, h_kv*d_k with h_kv = {h_kv} gives {implied}"
        )
    w_v = _params.matrix(_MHA, xp, params, "w_v", rows=value.shape[-1], rows_name="d_value", dtype=query.dtype)
    if w_v.shape[1] % h_kv:
        raise ValueError(
            f"{_MHA}: params['w_v'] must have h_kv*d_v columns with h_kv = {h_kv}, got shape {_checks.shape_of(w_v)}"
        )
    d_v = w_v.shape[1] // h_kv
    d_out = h * d_v
    if params.get("w_o") is not None:
        d_out = _params.matrix(
            _MHA, xp, params, "w_o", rows=h * d_v, rows_name=f"h*d_v = {h}*{d_v}", dtype=query.dtype
        ).shape[1]
    for bias, size in (("b_q", h * d_k), ("b_k", h_kv * d_k), ("b_v", h_kv * d_v), ("b_o", d_out)):
        if bias == "b_o" and params.get("w_o") is None and params.get("b_o") is not None:
            raise ValueError(f"{_MHA}: params['b_o'] needs params['w_o']")
        _params.vector(_MHA, xp, params, bias, size=size, dtype=query.dtype)
    if (params.get("bias_k") is None) != (params.get("bias_v") is None):
        raise ValueError(f"{_MHA}: params['bias_k'] and params['bias_v'] come together: give both or neither")
    _params.vector(_MHA, xp, params, "bias_k", size=h_kv * d_k, dtype=query.dtype)
    _params.vector(_MHA, xp, params, "bias_v", size=h_kv * d_v, dtype=query.dtype)
    return {"h": h, "h_kv": h_kv, "d_k": d_k, "d_v": d_v}


def project(x: Any, params: Mapping[str, Any], weight: str, bias: str) -> Any:
    """``x @ params[weight]``, plus ``params[bias]`` where the layer has
    one: a projection of the heads (here and in :mod:`attnx.torch`)."""
    y = x @ params[weight]
    b = params.get(bias)
    return y if b is None else y + b


def _append_position(xp: Any, x: Any, row: Any) -> Any:
    """``x (..., m, width)`` with ``row (width,)`` as position ``m``."""
    return xp.concat([x, xp.broadcast_to(row, (*x.shape[:-2], 1, x.shape[-1]))], axis=-2)


def _split_heads(xp: Any, x: Any, heads: int) -> Any:
    """(..., n, heads*d) -> (..., heads, 1, n, d): the 1 broadcasts over query groups."""
    *lead, n, width = x.shape
    x = xp.reshape(x, (*lead, n, heads, 1, width // heads))
    axes = tuple(range(len(lead)))
    return xp.permute_dims(x, (*axes, len(lead) + 1, len(lead) + 2, len(lead), len(lead) + 3))


def heads_in(
    xp: Any,
    query: Any,
    key: Any,
    value: Any,
    params: Mapping[str, Any],
    layout: dict[str, int],
    mask: Any,
    mask_per_head: bool,
    key_lengths: Any,
    is_causal: bool,
    add_zero_attn: bool,
) -> tuple[Any, Any, Any, Any, bool, int]:
    """The attention each head computes: ``(q, k, v, mask, is_causal,
    extra)``, the projected heads ``(..., h_kv, groups, n, d_k)`` and
    ``(..., h_kv, 1, m + extra, d)``, the masks as one for the heads (the
    causal rule in it where keys were appended), and the ``extra`` keys
    appended (``bias_k``, ``add_zero_attn``).  The forward and its backward
    (:func:`multi_head_attention_vjp`) both start here."""
    h, h_kv = layout["h"], layout["h_kv"]
    groups = h // h_kv
    n, m = query.shape[-2], key.shape[-2]
    k, v = project(key, params, "w_k", "b_k"), project(value, params, "w_v", "b_v")
    extra = 0  # keys appended after the projections, attended by every query
    if params.get("bias_k") is not None:
        k, v = _append_position(xp, k, params["bias_k"]), _append_position(xp, v, params["bias_v"])
        extra += 1
    # Query heads as (h_kv, groups): query head i = kv * groups + g uses key/value head kv.
    q = _split_heads(xp, project(query, params, "w_q", "b_q"), h)
    q = xp.reshape(q, (*q.shape[:-4], h_kv, groups, n, q.shape[-1]))
    k, v = _split_heads(xp, k, h_kv), _split_heads(xp, v, h_kv)
    if add_zero_attn:
        k, v = (
            _append_position(xp, a, xp.zeros(a.shape[-1], dtype=a.dtype, device=_checks.device_of(a))) for a in (k, v)
        )
        extra += 1
    batch_shape = _checks.leading_shape(query, key, value)
    if mask is not None and mask.ndim < 2:  # a row of keys or a scalar: (1, m) or (1, 1), for the heads' axes below
        mask = xp.reshape(mask, (1,) * (2 - mask.ndim) + tuple(mask.shape))
    padding = None
    if key_lengths is not None:
        padding = _heads_axis(xp, _masking.lengths_mask(xp, key_lengths, batch_shape, n, m), mask_per_head)
    if extra and is_causal:  # the causal rule covers the m given keys only
        causal = _masking.causal(xp, n, m, device=_checks.device_of(query))
        padding = causal if padding is None else padding & causal
        is_causal = False
    if padding is not None:
        if mask is None or mask.dtype == xp.bool:
            mask = padding if mask is None else padding & mask
        else:
            mask = _masking.as_additive(xp, padding, mask, mask.dtype)
    mask = _masking.allow_extra_keys(xp, mask, m, extra)
    if mask is not None:
        if mask_per_head:
            shape = mask.shape
            mask = (
                xp.reshape(mask, (*shape[:-3], h_kv, groups, *shape[-2:])) if shape[-3] == h else mask[..., None, :, :]
            )
        else:
            mask = mask[..., None, None, :, :]
    return q, k, v, mask, is_causal, extra


def _multi_head_generic(
    xp: Any,
    *,
    query: Any,
    key: Any,
    value: Any,
    params: Mapping[str, Any],
    layout: dict[str, int],
    mask: Any,
    mask_per_head: bool,
    key_lengths: Any,
    is_causal: bool,
    return_weights: bool,
    average_weights: bool,
    add_zero_attn: bool = False,
    chunk_size: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: Any = None,
) -> Any:
    h, d_v = layout["h"], layout["d_v"]
    n, m = query.shape[-2], key.shape[-2]
    q, k, v, mask, is_causal, extra = heads_in(
        xp, query, key, value, params, layout, mask, mask_per_head, key_lengths, is_causal, add_zero_attn
    )
    result = scaled_dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        is_causal=is_causal,
        return_weights=return_weights,
        chunk_size=chunk_size,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
    )
    heads, weights = result if return_weights else (result, None)
    lead = heads.shape[:-4]
    heads = xp.reshape(heads, (*lead, h, n, d_v))
    axes = tuple(range(len(lead)))
    concat = xp.reshape(xp.permute_dims(heads, (*axes, len(lead) + 1, len(lead), len(lead) + 2)), (*lead, n, h * d_v))
    output = project(concat, params, "w_o", "b_o") if params.get("w_o") is not None else concat
    if not return_weights:
        return output
    weights = xp.reshape(weights, (*lead, h, n, m + extra))
    return output, (xp.mean(weights, axis=-3) if average_weights else weights)


def _heads_axis(xp: Any, padding: Any, per_head: bool) -> Any:
    return padding[..., None, :, :] if per_head else padding


def init_multi_head_params(
    d_model: int,
    num_heads: int,
    *,
    d_k: int | None = None,
    d_v: int | None = None,
    d_query: int | None = None,
    d_key: int | None = None,
    d_value: int | None = None,
    num_kv_heads: int | None = None,
    bias: bool = True,
    seed: int = 0,
    dtype: DType = None,
    backend: str | None = None,
    device: Device = None,
) -> dict[str, Any]:
    """Parameters for :func:`multi_head_attention`, Xavier-uniform like PyTorch.

    The numbers are drawn once, in float64 with NumPy's generator seeded by
    ``seed``, then converted: the same seed gives the same parameters on
    every backend.  Biases start at zero.

    Parameters
    ----------
    d_model : int
        Output width (and the default of ``d_query``, ``d_key``, ``d_value``).
    num_heads : int
    d_k, d_v : int, optional
        Per-head widths; ``d_model // num_heads`` by default.
    d_query, d_key, d_value : int, optional
        Input widths, for cross-attention between different widths.
    num_kv_heads : int, optional
        Grouped-query attention (see :func:`multi_head_attention`).
    dtype : str or dtype, optional
        ``"float32"`` by default.

    Returns
    -------
    dict of str to array
        ``w_q, w_k, w_v, w_o`` and, with ``bias=True``, ``b_q, b_k, b_v, b_o``.

    Raises
    ------
    TypeError
        If ``dtype`` is not a real floating dtype of the backend, or a size
        is not an integer.
    ValueError
        If a size is not positive, or ``num_heads`` does not divide
        ``d_model`` and no ``d_k`` and ``d_v`` are given, or ``num_kv_heads``
        does not divide ``num_heads``.
    BackendUnavailableError
        If the backend that would run the call cannot run here (its library is
        not installed, or it has no device).

    Examples
    --------
    >>> import attnx
    >>> params = attnx.init_multi_head_params(16, 4, seed=0)
    >>> {name: tuple(array.shape) for name, array in sorted(params.items())}
    {'b_k': (16,), 'b_o': (16,), 'b_q': (16,), 'b_v': (16,), 'w_k': (16, 16), 'w_o': (16, 16), 'w_q': (16, 16), 'w_v': (16, 16)}
    >>> attnx.init_multi_head_params(15, 4)
    Traceback (most recent call last):
        ...
    ValueError: init_multi_head_params: num_heads = 4 must divide d_model = 15, or pass d_k and d_v
    """
    op = "init_multi_head_params"
    _checks.require_flag(op, "bias", bias)
    d_model = _checks.require_positive_int(op, "d_model", d_model)
    h = _checks.require_positive_int(op, "num_heads", num_heads)
    h_kv = h if num_kv_heads is None else _checks.require_positive_int(op, "num_kv_heads", num_kv_heads)
    if h % h_kv:
        raise ValueError(f"{op}: num_kv_heads must divide num_heads = {h}, got {h_kv}")
    if d_k is None and d_model % h:
        raise ValueError(f"{op}: num_heads = {h} must divide d_model = {d_model}, or pass d_k and d_v")
    d_k = d_model // h if d_k is None else _checks.require_positive_int(op, "d_k", d_k)
    d_v = d_k if d_v is None else _checks.require_positive_int(op, "d_v", d_v)
    d_query = d_model if d_query is None else _checks.require_positive_int(op, "d_query", d_query)
    d_key = d_model if d_key is None else _checks.require_positive_int(op, "d_key", d_key)
    d_value = d_key if d_value is None else _checks.require_positive_int(op, "d_value", d_value)
    shapes = {
        "w_q": (d_query, h * d_k),
        "w_k": (d_key, h_kv * d_k),
        "w_v": (d_value, h_kv * d_v),
        "w_o": (h * d_v, d_model),
    }
    biases = {"b_q": h * d_k, "b_k": h_kv * d_k, "b_v": h_kv * d_v, "b_o": d_model} if bias else {}
    return _params.create(op, backend, seed, dtype, device, xavier=shapes, zeros=biases)


class MultiHeadAttention:
    """Multi-head attention holding its parameters.

    ``MultiHeadAttention(d_model, num_heads, ...)`` takes the arguments of
    :func:`init_multi_head_params`; ``module(query, key=None, value=None,
    **kwargs)`` calls :func:`multi_head_attention` (``key`` and ``value``
    default to ``query``: self-attention).

    Parameters
    ----------
    batch_first : bool
        Inputs are ``(..., batch, n, d)`` (the default), or ``(n, batch, d)``
        as ``torch.nn.MultiheadAttention(batch_first=False)`` takes them; the
        output has the inputs' layout, the weights are ``(batch, ..., n, m)``
        either way (as PyTorch returns them).
    add_zero_attn : bool
        Passed to every call (see :func:`multi_head_attention`).
    dropout : float
        Dropout on the weights in training mode (PyTorch's ``dropout``); 0
        by default.
    dropout_seed : int
        The first call's seed in training mode; each call takes the next,
        unless it is given its own ``dropout_seed``.

    Attributes
    ----------
    params : dict of str to array
    num_heads, num_kv_heads : int
    batch_first, add_zero_attn : bool
    dropout : float
    training : bool
        Whether calls drop weights (with ``dropout > 0``): True after
        :meth:`train`, the default as PyTorch's modules, False after
        :meth:`eval`.

    Raises
    ------
    ValueError
        As :func:`init_multi_head_params` when making the parameters, and as
        :func:`multi_head_attention` when called.

    Examples
    --------
    Load a ``torch.nn.MultiheadAttention`` and get its outputs (its masks are
    the inverse of attnx's: ``True`` there means *ignore*)::

        torch_mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
        mha = attnx.MultiHeadAttention.from_torch(torch_mha)
        mha(x)  # == torch_mha(x, x, x, need_weights=False)[0]

    Self-attention on NumPy, and the same module's weights:

    >>> import numpy as np
    >>> import attnx
    >>> mha = attnx.MultiHeadAttention(16, 4, seed=0, dtype="float64")
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 16))
    >>> mha(x).shape
    (2, 5, 16)
    >>> out, weights = mha(x, return_weights=True, is_causal=True)
    >>> print(weights[0, 1].round(2))
    [0.58 0.42 0.   0.   0.  ]
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        params: Mapping[str, Any] | None = None,
        batch_first: bool = True,
        add_zero_attn: bool = False,
        dropout: float = 0.0,
        dropout_seed: int = 0,
        **init: Array,
    ) -> None:
        op = "MultiHeadAttention"
        self.num_heads = num_heads
        self.num_kv_heads = init.get("num_kv_heads") or num_heads
        self.batch_first = _checks.require_flag(op, "batch_first", batch_first)
        self.add_zero_attn = _checks.require_flag(op, "add_zero_attn", add_zero_attn)
        self.dropout = _dropout.require_probability(op, "dropout", dropout)
        if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int):
            raise TypeError(f"{op}: dropout_seed must be an int, got {type(dropout_seed).__name__}")
        self._next_seed = dropout_seed
        self.training = True
        self.params = dict(params) if params is not None else init_multi_head_params(d_model, num_heads, **init)

    def train(self, mode: bool = True) -> MultiHeadAttention:
        """Training mode (dropout on, where ``dropout > 0``), or evaluation
        mode with ``mode=False``; returns the module, as PyTorch's does."""
        self.training = _checks.require_flag("MultiHeadAttention.train", "mode", mode)
        return self

    def eval(self) -> MultiHeadAttention:
        """Evaluation mode: no dropout.  Returns the module."""
        return self.train(False)

    @classmethod
    def from_torch(cls, module: Any) -> MultiHeadAttention:
        """A copy of a ``torch.nn.MultiheadAttention`` that computes exactly
        what it computes: separate or packed projections (``kdim``,
        ``vdim``), ``bias`` on or off, ``add_bias_kv``, ``add_zero_attn``,
        and its ``batch_first`` layout.

        The parameters are the module's own tensors (views, sharing storage),
        so gradients reach the module.  Its ``dropout`` and its mode
        (``training``) are copied: in training mode attnx drops weights with
        the same probability, by its own mask (:func:`multi_head_attention`'s
        ``dropout_seed``), not PyTorch's generator's.
        """
        e = module.embed_dim
        if module.in_proj_weight is not None:
            w_q, w_k, w_v = (w.T for w in module.in_proj_weight.split(e, dim=0))
        else:
            w_q, w_k, w_v = (module.q_proj_weight.T, module.k_proj_weight.T, module.v_proj_weight.T)
        params = {"w_q": w_q, "w_k": w_k, "w_v": w_v, "w_o": module.out_proj.weight.T}
        if module.in_proj_bias is not None:
            params.update(zip(("b_q", "b_k", "b_v"), module.in_proj_bias.split(e, dim=0)))
        if module.out_proj.bias is not None:
            params["b_o"] = module.out_proj.bias
        if module.bias_k is not None:  # (1, 1, e): one extra key and value
            params["bias_k"], params["bias_v"] = module.bias_k.reshape(e), module.bias_v.reshape(e)
        return cls(
            e,
            module.num_heads,
            params=params,
            batch_first=bool(module.batch_first),
            add_zero_attn=bool(module.add_zero_attn),
            dropout=float(module.dropout),
        ).train(bool(module.training))

    def __call__(self, query: Array, key: Array = None, value: Array = None, **kwargs: Array) -> Array:
        key = query if key is None else key
        value = key if value is None else value
        kwargs.setdefault("num_kv_heads", self.num_kv_heads)
        kwargs.setdefault("add_zero_attn", self.add_zero_attn)
        if self.training and self.dropout and "dropout_p" not in kwargs:
            kwargs["dropout_p"] = self.dropout
            if "dropout_seed" not in kwargs:  # a seed a call, in turn
                kwargs["dropout_seed"], self._next_seed = self._next_seed, self._next_seed + 1
        sequence_first = not self.batch_first and query.ndim >= 3
        if sequence_first:  # (n, batch, d) -> (batch, n, d), and back for the output
            query, key, value = (_swap_sequence_and_batch(x) for x in (query, key, value))
        result = multi_head_attention(query, key, value, self.params, num_heads=self.num_heads, **kwargs)
        if not sequence_first:
            return result
        if isinstance(result, tuple):
            return _swap_sequence_and_batch(result[0]), result[1]
        return _swap_sequence_and_batch(result)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in self.params.items())
        return (
            f"MultiHeadAttention(num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"batch_first={self.batch_first}, add_zero_attn={self.add_zero_attn}, "
            + (f"dropout={self.dropout}, training={self.training}, " if self.dropout else "")
            + f"{shapes})"
        )


def _swap_sequence_and_batch(x: Any) -> Any:
    """``(..., n, batch, d)`` <-> ``(..., batch, n, d)``."""
    chosen, _ = _dispatch.resolve("MultiHeadAttention", None, ("x",), (x,))
    axes = list(range(x.ndim))
    axes[-3], axes[-2] = axes[-2], axes[-3]
    return chosen.xp.permute_dims(x, tuple(axes))


def _merge_heads(xp: Any, x: Any) -> Any:
    """(..., heads, 1, n, d) -> (..., n, heads*d): :func:`_split_heads` undone."""
    *lead, heads, _, n, width = x.shape
    axes = tuple(range(len(lead)))
    x = xp.permute_dims(x[..., 0, :, :], (*axes, len(lead) + 1, len(lead), len(lead) + 2))
    return xp.reshape(x, (*lead, n, heads * width))


def multi_head_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    params: Mapping[str, Any],
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    mask: Any = None,
    key_lengths: Any = None,
    is_causal: bool = False,
    return_weights: bool = False,
    average_weights: bool = True,
    add_zero_attn: bool = False,
    chunk_size: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: Any = None,
    backend: str | None = None,
) -> tuple[Any, Callable[[Any], dict[str, Any]]]:
    """:func:`attnx.vjp` of :func:`multi_head_attention`: the output, and a
    backward giving ``query``, ``key``, ``value`` and ``params`` (a dict by
    the params' names).  The heads' attention is
    :func:`~attnx._attention_vjp.scaled_dot_product_attention_vjp`'s, tiled;
    around it each projection's transpose, the heads split and merged back,
    and the appended keys' rows taken off into ``bias_k``/``bias_v``."""
    operation = f"vjp({_MHA})"
    _checks.require_flag(operation, "return_weights", return_weights)
    if return_weights:
        raise ValueError(f"{operation}: return_weights=True has two outputs; differentiate the output alone")
    xp = _dispatch.resolve(operation, backend, ("query", "key", "value"), (query, key, value), 3)[0].xp
    output = multi_head_attention(
        query,
        key,
        value,
        params,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        mask=mask,
        key_lengths=key_lengths,
        is_causal=is_causal,
        add_zero_attn=add_zero_attn,
        chunk_size=chunk_size,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        backend=backend,
    )
    layout = check_multi_head(xp, query, key, value, params, num_heads, num_kv_heads)
    per_head = mask is not None and mask.ndim == len(_checks.leading_shape(query, key, value)) + 3
    q, k, v, heads_mask, heads_causal, extra = heads_in(
        xp, query, key, value, params, layout, mask, per_head, key_lengths, is_causal, add_zero_attn
    )
    heads, heads_backward = scaled_dot_product_attention_vjp(
        q,
        k,
        v,
        mask=heads_mask,
        is_causal=heads_causal,
        chunk_size=chunk_size,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        backend=backend,
    )
    h, d_v, n = layout["h"], layout["d_v"], query.shape[-2]
    lead = heads.shape[:-4]
    concat = _merge_heads(xp, xp.reshape(heads, (*lead, h, 1, n, d_v)))

    def backward(cotangent: Any) -> dict[str, Any]:
        _cotangents.require(operation, cotangent, output)
        grads: dict[str, Any] = {}
        d_concat = cotangent
        if params.get("w_o") is not None:
            grads["w_o"] = _cotangents.leading_sum(xp, xp.matrix_transpose(concat) @ cotangent, 2)
            if params.get("b_o") is not None:
                grads["b_o"] = _cotangents.leading_sum(xp, cotangent, 1)
            d_concat = cotangent @ xp.matrix_transpose(params["w_o"])
        d_heads = _split_heads(xp, d_concat, h)  # (..., h, 1, n, d_v)
        d_heads = xp.reshape(d_heads, heads.shape)  # (..., h_kv, groups, n, d_v)
        heads_grads = heads_backward(d_heads)  # once: the tiled backward is the bulk of the work
        inputs = {}
        d_q, d_k, d_v_heads = heads_grads["query"], heads_grads["key"], heads_grads["value"]
        d_q, d_k, d_v_heads = (
            _merge_heads(xp, a) for a in (xp.reshape(d_q, (*d_q.shape[:-4], h, 1, n, d_q.shape[-1])), d_k, d_v_heads)
        )
        if add_zero_attn:  # the zeros' key and value: no parameter behind them
            d_k, d_v_heads = d_k[..., :-1, :], d_v_heads[..., :-1, :]
        if params.get("bias_k") is not None:  # the appended key and value, one row each
            grads["bias_k"] = _cotangents.leading_sum(xp, d_k[..., -1, :], 1)
            grads["bias_v"] = _cotangents.leading_sum(xp, d_v_heads[..., -1, :], 1)
            d_k, d_v_heads = d_k[..., :-1, :], d_v_heads[..., :-1, :]
        if "mask" in heads_grads:  # a real mask, added to every head's scores: back from the heads' layout
            d_mask = heads_grads["mask"][..., : heads_grads["mask"].shape[-1] - extra]  # not the appended keys'
            shape = tuple(d_mask.shape)
            d_mask = (
                xp.reshape(d_mask, (*shape[:-4], shape[-4] * shape[-3], *shape[-2:]))
                if per_head
                else d_mask[..., 0, 0, :, :]
            )
            inputs["mask"] = _cotangents.like(xp, d_mask, mask)
        for name, x, d_projected, weight, bias in (
            ("query", query, d_q, "w_q", "b_q"),
            ("key", key, d_k, "w_k", "b_k"),
            ("value", value, d_v_heads, "w_v", "b_v"),
        ):
            grads[weight] = _cotangents.leading_sum(xp, xp.matrix_transpose(x) @ d_projected, 2)
            if params.get(bias) is not None:
                grads[bias] = _cotangents.leading_sum(xp, d_projected, 1)
            inputs[name] = _cotangents.like(xp, d_projected @ xp.matrix_transpose(params[weight]), x)
        return {**inputs, "params": {name: grads[name] for name in params if params.get(name) is not None}}

    return output, backward
