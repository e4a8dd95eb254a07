"""Scaled dot-product attention and the masked softmax."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

from attnx import _checks, _dispatch, _dropout, _grouping, _masking, _plans, _tiling, _tracing
from attnx._tiling import KEY_CHUNK, MIN_ROWS
from attnx._typing import Array
from attnx.backend import Backend

__all__ = ["masked_softmax", "scaled_dot_product_attention"]

_SDPA = "scaled_dot_product_attention"
_SDPA_ARGS = ("query", "key", "value", "mask", "key_lengths", "scale", "dropout_seed")


def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array = None,
    key_lengths: Array = None,
    is_causal: bool = False,
    causal_align: str = "bottom_right",
    scale: float | Array | None = None,
    enable_gqa: bool = False,
    return_weights: bool = False,
    chunk_size: int | tuple[int, int] | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | Array | None = None,
    backend: str | None = None,
) -> Array:
    r"""Scaled dot-product attention, :math:`\mathrm{softmax}(q k^T s + M) v`.

    Parameters
    ----------
    query : array, shape (..., n, d_k)
    key : array, shape (..., m, d_k)
    value : array, shape (..., m, d_v)
        Leading dimensions broadcast against each other, so one key/value
        head can serve many query heads.  All three share one floating dtype.
    mask : array, optional
        Broadcastable to ``(..., n, m)``.  Boolean: ``True`` where a query may
        attend a key (PyTorch SDPA's convention, the inverse of
        ``nn.MultiheadAttention``'s).  Real-valued: added to the scores, with
        ``-inf`` forbidding.
    key_lengths : integer array, optional
        Keys at positions ``>= length`` are ignored (padding).  Shape ``(B,)``
        with one length per sequence of the batch (``B`` is the first leading
        dimension, shared by the others, such as heads), or the leading shape
        ``(...)`` (broadcastable), or ``(..., n)`` for one length per query.
    is_causal : bool
        Query ``i`` attends key ``j`` only where ``j <= i + (m - n)``: aligned
        to the end, the usual lower triangle when ``n == m`` and right for
        decoding with cached keys.  (PyTorch aligns to the start; pass
        ``mask=attnx.masks.causal(n, m, align="top_left")`` for that.)
    causal_align : {"bottom_right", "key_lengths"}
        With ``is_causal=True``, what the last query is aligned to: the
        last of the ``m`` keys (the default), or the last of each
        sequence's own ``key_lengths`` (decoding, or prefill in chunks, over
        caches of different lengths: the ``n`` queries are the last ``n``
        tokens of each sequence, FlashAttention's ``seqused_k``).  Query
        ``i`` of a sequence of ``L`` keys then attends ``j <= i + L - n``.
    scale : float or 0-d array, optional
        Multiplies the scores; ``1 / sqrt(d_k)`` by default.  A 0-d array of
        the inputs' backend may be traced (``jax.jit``, ``torch.compile``)
        and receives gradients.
    enable_gqa : bool
        Grouped-query attention, as PyTorch's: ``query (..., H, n, d_k)``
        against ``key (..., H_kv, m, d_k)`` and ``value (..., H_kv, m,
        d_v)``, where query head ``h`` reads key/value head ``h // (H /
        H_kv)``, without copying keys or values.  A mask's or
        ``key_lengths``' head axis has size ``H`` (or 1).
    return_weights : bool
        Also return the attention weights.
    chunk_size : int or (int, int), optional
        Use the memory-efficient algorithm (an online softmax over blocks) with this
        many queries (and keys) per block and (batch, head) slice.  By
        default it is used when the score matrix would exceed the memory
        budget (:func:`attnx.set_memory_budget`, 4 MiB unless set).  It
        never materialises the weights, so it can't be combined with
        ``return_weights=True``.  A backend's native implementation may cut
        the work its own way, within the same budget.
    dropout_p : float
        Drop each weight with this probability, and scale those kept by
        ``1 / (1 - dropout_p)`` (PyTorch's ``dropout_p``); 0 by default,
        which costs nothing.
    dropout_seed : int or 0-d integer array, optional
        Required with ``dropout_p > 0``: the mask is a hash of the seed and
        each weight's position (leading indices, query, key), the same on
        every backend and device; a 0-d array may be traced.  Give each
        step of training its own seed.
    backend : str, optional
        Run on this backend; by default the one that owns the inputs.

    Returns
    -------
    output : array, shape (..., n, d_v)
        Same array type, dtype and device as ``query``.
    weights : array, shape (..., n, m)
        Only with ``return_weights=True``; after dropout, where asked.

    Raises
    ------
    TypeError
        If an input is not an array of a registered backend, the inputs come
        from two backends, or ``backend=`` does not own them.
        If ``query``, ``key`` and ``value`` are not of one real floating dtype,
        ``mask`` is neither boolean nor real floating, ``key_lengths`` is not
        integer, a flag is not ``True`` or ``False``, ``scale`` is not a
        real number, ``dropout_p`` is not a float, or ``dropout_seed`` is
        not an int or a 0-d integer array of the inputs' backend.
    ValueError
        If an input has fewer than 2 dimensions, ``d_k`` or ``m`` disagree,
        the leading shapes do not broadcast, ``mask`` does not broadcast to
        ``(..., n, m)``, ``key_lengths`` has another shape, or ``chunk_size``
        is not positive or is combined with ``return_weights=True``,
        ``enable_gqa=True`` is given inputs of fewer than 3 dimensions or
        ``H`` not a multiple of ``H_kv``, ``causal_align`` is not one of
        its values or is ``"key_lengths"`` without ``is_causal=True`` and
        ``key_lengths``,
        ``dropout_p`` lies outside ``[0, 1]`` or comes without a
        ``dropout_seed``; and, on
        arrays whose values can be read (not traced, not lazy), if a
        ``key_lengths`` entry lies outside ``[0, m]``, a real mask holds
        ``+inf`` or NaN, or ``scale`` is not finite in the scores' dtype.
        If ``backend=`` names no registered backend, or the inputs lie on
        two different devices.
    BackendUnavailableError
        If the backend that would run the call cannot run here (its library is
        not installed, or it has no device).

    Notes
    -----
    All masks combine.  A query with no key left to attend gets zeros as
    output and as weights, never NaN.  Half-precision inputs are computed
    in float32 and returned in their own dtype.  With dropout, attnx's
    generic algorithm runs (natives' kernels draw their masks their own
    way), and its backward (:func:`attnx.vjp`, PyTorch's autograd through
    tiles) makes the mask again rather than keeping it.

    Examples
    --------
    >>> import numpy as np
    >>> import attnx
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 5, 8))    # (batch, heads, n, d_k)
    >>> k = rng.standard_normal((2, 4, 3, 8))    # (batch, heads, m, d_k)
    >>> v = rng.standard_normal((2, 4, 3, 16))   # (batch, heads, m, d_v)
    >>> attnx.scaled_dot_product_attention(q, k, v).shape
    (2, 4, 5, 16)

    Padding and the causal rule combine; a query with no key left to attend
    gets zeros, never NaN:

    >>> out, weights = attnx.scaled_dot_product_attention(
    ...     q, k, v, is_causal=True, key_lengths=np.array([3, 2]), return_weights=True)
    >>> print(weights[1, 0].round(2))
    [[0.   0.   0.  ]
     [0.   0.   0.  ]
     [1.   0.   0.  ]
     [0.46 0.54 0.  ]
     [0.44 0.56 0.  ]]
    >>> print(np.abs(out[1, :, :2]).max())
    0.0

    Dropout takes a seed; the same seed drops the same weights on every
    backend:

    >>> _, dropped = attnx.scaled_dot_product_attention(
    ...     q, k, v, return_weights=True, dropout_p=0.5, dropout_seed=1)
    >>> print(dropped[0, 0].round(2))
    [[0.   0.   0.  ]
     [0.   0.   0.  ]
     [0.   0.   0.65]
     [0.   0.   0.  ]
     [0.44 0.46 1.1 ]]

    Bad input is refused before any work, naming the argument:

    >>> attnx.scaled_dot_product_attention(q, k[..., :4], v)
    Traceback (most recent call last):
        ...
    ValueError: scaled_dot_product_attention: key must have shape (..., m, d_k) with d_k = 8 (from query), got (2, 4, 3, 4)
    """
    signature = None
    if (
        type(query) in _plans.planning_types
        and mask is None
        and key_lengths is None
        and causal_align == "bottom_right"
        and chunk_size is None
        and not dropout_p
        and (scale is None or type(scale) is float)
        and type(is_causal) is bool
        and type(return_weights) is bool
        and enable_gqa is False
        and (backend is None or type(backend) is str)
        and not _tracing.compiling()  # a compiled graph checks once anyway, and must not guard on the plans
    ):
        plan, signature = _plans.lookup(_SDPA, (query, key, value), (is_causal, scale, return_weights, backend))
        if plan is not None:  # this signature was validated before: see attnx._plans
            return plan(query, key, value)
    call = validated_call(
        _SDPA,
        query,
        key,
        value,
        mask=mask,
        key_lengths=key_lengths,
        is_causal=is_causal,
        causal_align=causal_align,
        scale=scale,
        enable_gqa=enable_gqa,
        return_weights=return_weights,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        backend=backend,
    )
    result = computed(call, chunk_size=chunk_size, dropout_seed=dropout_seed, signature=signature)
    if not enable_gqa:
        return result
    if return_weights:
        return tuple(call.given(part) for part in result)
    return call.given(result)


class ValidatedCall(NamedTuple):
    """A call of :func:`scaled_dot_product_attention` checked, in the
    layout attnx computes it (:func:`as_computed`): what its forward and
    its backward (:func:`attnx.vjp`) share."""

    chosen: Backend
    reason: str
    computed: _grouping.GroupedCall
    scale: Any  # a Python float, or a 0-d array
    given_batch_shape: tuple[int, ...]
    given_n: int
    return_weights: bool
    dropout_p: float
    grouped: bool

    def given(self, result: Any) -> Any:
        """A result ``(..., n, d)`` of the computed call in the caller's layout."""
        if not self.grouped:
            return result
        return _grouping.ungroup(self.chosen.xp, result, (*self.given_batch_shape, self.given_n, result.shape[-1]))


def validated_call(
    operation: str,
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any = None,
    key_lengths: Any = None,
    is_causal: Any = False,
    causal_align: str = "bottom_right",
    scale: Any = None,
    enable_gqa: Any = False,
    return_weights: Any = False,
    dropout_p: Any = 0.0,
    dropout_seed: Any = None,
    backend: str | None = None,
) -> ValidatedCall:
    """Every check of a call of :func:`scaled_dot_product_attention`, before
    any work; the errors name ``operation``.  The defaults are its own."""
    chosen, reason = _dispatch.resolve(
        operation,
        backend,
        _SDPA_ARGS,
        (query, key, value, mask, key_lengths, _checks.scale_array(scale), _dropout.seed_array(dropout_seed)),
        3,
    )
    xp = chosen.xp
    if dropout_p or dropout_seed is not None:
        dropout_p = _dropout.require_dropout(operation, xp, dropout_p, dropout_seed, chosen.owns)
    # The common call (no flag set) skips the flags' checks.
    if is_causal is not False or return_weights is not False or enable_gqa is not False:
        _checks.require_flag(operation, "is_causal", is_causal)
        _checks.require_flag(operation, "return_weights", return_weights)
        _checks.require_flag(operation, "enable_gqa", enable_gqa)
        if is_causal:
            _checks.require_known(operation, "is_causal", {"query": query, "key": key}, axes=(-2,))
    if causal_align != "bottom_right":
        _masking.check_causal_align(operation, causal_align, is_causal, key_lengths)
    scale, batch_shape, n, m = check_attention_inputs(
        operation, xp, query, key, value, mask, key_lengths, scale, enable_gqa=enable_gqa
    )
    call = _grouping.GroupedCall(query, key, value, mask, key_lengths, is_causal, batch_shape, n)
    if causal_align != "bottom_right" or enable_gqa:
        call = as_computed(xp, call, causal_align=causal_align, enable_gqa=enable_gqa, dropout_p=dropout_p)
    return ValidatedCall(chosen, reason, call, scale, batch_shape, n, return_weights, dropout_p, enable_gqa)


def planned_chunks(call: ValidatedCall, chunk_size: Any) -> tuple[tuple[int, int] | None, int]:
    """``(chunks, block_bytes)`` of a validated call: its tiles, as
    :func:`choose_chunks` plans them (None: no tiles), and the bytes of a
    block on its device, the forward and its backward alike."""
    chosen = call.chosen
    query, key, _, _, _, is_causal, batch_shape, n = call.computed
    block_bytes = chosen.block_bytes_on(_checks.device_of(query))
    if _checks.traced(query):  # a traced program compiles each block and dispatches none
        block_bytes = max(block_bytes, _tiling.TRACED_BLOCK_BYTES)
    chunks = choose_chunks(
        chosen.xp,
        query.dtype,
        n,
        key.shape[-2],
        batch_shape,
        chunk_size,
        call.return_weights,
        is_causal,
        chosen.concurrent_blocks,
        block_bytes,
    )
    return chunks, block_bytes


def computed(call: ValidatedCall, *, chunk_size: Any, dropout_seed: Any, signature: Any = None) -> Any:
    """The result of a validated call, in its computed layout: the
    backend's native where it takes the call, else the generic algorithm
    (in tiles where :func:`choose_chunks` says).  ``signature``: the call's
    plan key (:mod:`attnx._plans`), for a backend's plan of it."""
    chosen, xp = call.chosen, call.chosen.xp
    query, key, value, mask, key_lengths, is_causal, batch_shape, n = call.computed
    chunks, block_bytes = planned_chunks(call, chunk_size)
    arguments = {
        "query": query,
        "key": key,
        "value": value,
        "mask": mask,
        "key_lengths": key_lengths,
        "is_causal": is_causal,
        "scale": call.scale,
        "return_weights": call.return_weights,
        "chunks": chunks,
        "batch_shape": batch_shape,
        "chunk_size": chunk_size,
    }
    if signature is not None:
        plan = _plans.make(_SDPA, signature, chosen, call.reason, arguments)
        if plan is not None:
            return plan(query, key, value)
    options = {}
    if chunks is not None:
        options = {"map_blocks": chosen.map_blocks, "concurrent_blocks": chosen.concurrent_blocks}
        options.update(block_bytes=block_bytes, custom_vjp=chosen.custom_vjp)
    dropout_p = call.dropout_p
    if dropout_p:
        options["dropout"] = _dropout.make(xp, dropout_p, dropout_seed, batch_shape, query)
    return _dispatch.call(
        _SDPA, chosen, call.reason, sdpa_generic, arguments, options, generic_for="dropout" if dropout_p else None
    )


def as_computed(
    xp: Any, call: _grouping.GroupedCall, *, causal_align: str, enable_gqa: bool, dropout_p: float
) -> _grouping.GroupedCall:
    """A validated call as attnx computes it, the forward and its backward
    alike: the causal rule aligned to each sequence's keys as one length per
    query (padding, which every backend takes), and grouped heads as the
    broadcasting call of :func:`attnx._grouping.regroup` (folded where
    nothing tells a group's heads apart, unless dropout hashes them)."""
    if causal_align == "key_lengths":
        lengths = _masking.causal_by_lengths(xp, call.key_lengths, call.batch_shape, call.n)
        call = call._replace(key_lengths=lengths, is_causal=False)
    if not enable_gqa:
        return call
    return _grouping.regroup(xp, **call._asdict(), fold=not dropout_p)


#: Query rows per causal block, at most, as a fraction of n: thinner blocks
#: skip more of the future (a block computes up to its own square in vain).
CAUSAL_BLOCKS = 8
#: Scores (elements) from which a backend that runs blocks concurrently gets
#: the chunked algorithm within the memory budget too: below, threads cost
#: more than they save (measured on NumPy, 2 cores: 1.3x faster at 8 x 128 x
#: 128 scores, 1.7x at 8 x 256 x 256, 2x slower at 8 x 64 x 64).
PARALLEL_SCORES = 2**17


def choose_chunks(
    xp: Any,
    dtype: Any,
    n: int,
    m: int,
    batch_shape: tuple[int, ...],
    chunk_size: Any,
    return_weights: bool,
    is_causal: bool = False,
    concurrent_blocks: int = 1,
    block_bytes: int = _tiling.BLOCK_BYTES,
) -> tuple[int, int] | None:
    """``(query_chunk, key_chunk)`` for the chunked algorithm on ``n`` queries
    and ``m`` keys of ``dtype`` in each (batch, head) slice, or None for the
    plain algorithm: ``chunk_size`` if given, else chunks when the scores of
    all slices would exceed the memory budget, or when ``concurrent_blocks``
    workers can share them (at least :data:`PARALLEL_SCORES` scores).
    ``block_bytes`` is the backend's for the arrays' device
    (:meth:`attnx.Backend.block_bytes_on`).

    The plan is per slice: a block's scores are ``query_chunk x key_chunk``
    for each slice it holds, and :func:`attnx._tiling.slices_per_block` says how many
    slices one block holds.
    """
    if chunk_size is not None:
        if return_weights:
            raise ValueError(
                f"{_SDPA}: chunk_size can't be combined with return_weights=True (the chunked algorithm never materialises the weights)"
            )
        pair = chunk_size if isinstance(chunk_size, tuple) else (chunk_size, KEY_CHUNK)
        if len(pair) != 2:
            raise ValueError(
                f"{_SDPA}: chunk_size must be an int or a (query_chunk, key_chunk) pair, got {chunk_size!r}"
            )
        query_chunk, key_chunk = (_checks.require_positive_int(_SDPA, "chunk_size", c) for c in pair)
        return min(query_chunk, max(n, 1)), min(key_chunk, max(m, 1))
    if return_weights:
        return None
    slices = math.prod(batch_shape)
    scores = slices * n * m
    if scores != scores:  # unknown sizes (NaN: a lazy array's): no plan, the array's own chunks decide
        return None
    shared = concurrent_blocks > 1 and scores >= PARALLEL_SCORES
    budget = _tiling.memory_budget(block_bytes)
    if scores * 8 <= budget and not shared:  # fits even in float64: the common, cheap case
        return None
    itemsize = _tiling.itemsize(xp, dtype)
    if scores * itemsize <= budget and not shared:
        return None
    block = _tiling.bytes_per_block(concurrent_blocks, block_bytes)
    # One slice's block of about that many bytes; keys give way before rows do.
    key_chunk = min(m, KEY_CHUNK)
    while key_chunk > 512 and block // (itemsize * key_chunk) < MIN_ROWS:
        key_chunk //= 2
    rows = max(MIN_ROWS, block // (itemsize * key_chunk))
    if is_causal:
        rows = min(rows, max(MIN_ROWS, n // CAUSAL_BLOCKS))
    if concurrent_blocks > slices:  # too few slices to give every worker a block: split rows too
        rows = min(rows, max(MIN_ROWS, -(-n * slices // concurrent_blocks)))
    return min(n, rows), key_chunk


def check_attention_inputs(
    operation: str,
    xp: Any,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    scale: Any,
    *,
    enable_gqa: bool = False,
) -> tuple[float, tuple[int, ...], int, int]:
    """Validate query/key/value/masks; returns the scale (a Python float, or
    a 0-d array: :func:`attnx._checks.require_scale`), the broadcast leading
    shape (``(..., H)`` with ``enable_gqa``: the query heads'), ``n`` and
    ``m``."""
    q_shape, k_shape, v_shape = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    if len(q_shape) < 2 or len(k_shape) < 2 or len(v_shape) < 2:
        _checks.require_ndim(operation, "query", query, 2, "(..., n, d_k)")
        _checks.require_ndim(operation, "key", key, 2, "(..., m, d_k)")
        _checks.require_ndim(operation, "value", value, 2, "(..., m, d_v)")
    dtype = query.dtype
    if not (_checks.is_float_dtype(xp, dtype) and key.dtype == dtype and value.dtype == dtype):
        for name, array in (("query", query), ("key", key), ("value", value)):
            _checks.require_float(operation, xp, name, array)
        _checks.require_same_dtype(operation, ("query", "key", "value"), (query, key, value))
    n, d_k = q_shape[-2], q_shape[-1]
    m = k_shape[-2]
    if k_shape[-1] != d_k and _checks.known(k_shape[-1], d_k):
        raise ValueError(f"{operation}: key must have shape (..., m, d_k) with d_k = {d_k} (from query), got {k_shape}")
    if v_shape[-2] != m and _checks.known(v_shape[-2], m):
        raise ValueError(f"{operation}: value must have shape (..., m, d_v) with m = {m} (from key), got {v_shape}")
    batch_shape = q_shape[:-2]
    if enable_gqa:
        heads, _ = _grouping.check_heads(operation, query, key, value)
        outer = _checks.broadcast(
            operation, {"query": q_shape[:-3], "key": k_shape[:-3], "value": v_shape[:-3]}, "shapes before the heads"
        )
        batch_shape = (*outer, heads)
    elif not batch_shape == k_shape[:-2] == v_shape[:-2]:
        batch_shape = _checks.broadcast(
            operation, {"query": batch_shape, "key": k_shape[:-2], "value": v_shape[:-2]}, _checks.LEADING
        )
    if mask is not None or key_lengths is not None:
        _checks.require_known(
            operation, "a mask", {"query": query, "key": key, "value": value, "mask": mask, "key_lengths": key_lengths}
        )
        _masking.check_masks(operation, xp, mask, key_lengths, batch_shape, n, m, scores_dtype=dtype)
    return _checks.require_scale(operation, xp, scale, d_k, dtype), batch_shape, n, m


def sdpa_generic(
    xp: Any,
    *,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    return_weights: bool,
    chunks: tuple[int, int] | None = None,
    batch_shape: tuple[int, ...] | None = None,
    chunk_size: Any = None,
    map_blocks: Callable[..., list[Any]] | None = None,
    concurrent_blocks: int = 1,
    block_bytes: int = _tiling.BLOCK_BYTES,
    custom_vjp: Callable[..., Any] | None = None,
    dropout: _dropout.Dropout | None = None,
) -> Any:
    """The generic algorithm, array API only (inputs already validated).
    ``chunk_size`` is the user's, for natives: ``chunks`` carries it here."""
    n, m = query.shape[-2], key.shape[-2]
    if n == 0 or m == 0:  # no queries, or no key to attend: zeros, as for fully masked rows
        return _empty_attention(xp, query, key, value, batch_shape, return_weights)
    if chunks is not None:
        return sdpa_chunked(
            xp,
            query=query,
            key=key,
            value=value,
            mask=mask,
            key_lengths=key_lengths,
            is_causal=is_causal,
            scale=scale,
            query_chunk=chunks[0],
            key_chunk=chunks[1],
            batch_shape=batch_shape,
            map_blocks=map_blocks,
            concurrent_blocks=concurrent_blocks,
            block_bytes=block_bytes,
            custom_vjp=custom_vjp,
            dropout=dropout,
        )
    dtype = query.dtype
    compute, (query, key, value) = _checks.in_accumulation_dtype(xp, query, key, value)
    if batch_shape is None:
        batch_shape = _checks.leading_shape(query, key, value)
    allowed = additive = None
    if mask is not None or key_lengths is not None or is_causal:
        allowed, additive = _masking.combine(
            xp,
            mask=mask,
            key_lengths=key_lengths,
            is_causal=is_causal,
            batch_shape=batch_shape,
            n=n,
            m=m,
            dtype=compute,
            device=_checks.device_of(query),
        )
    scores = (query * scale) @ xp.matrix_transpose(key)
    kept = None if dropout is None else dropout.tile(None, (0, n), (0, m))
    if return_weights:
        weights = _masking.softmax(xp, scores, allowed, additive)
        weights = weights if kept is None else weights * kept
        output = weights @ value
    else:
        # Normalise the (n, d_v) output rather than the (n, m) weights.
        exp_scores, _ = _masking.unnormalised_softmax(xp, scores, allowed, additive)
        masked = allowed is not None or additive is not None
        total = _masking.safe_total(xp, exp_scores, masked)
        output = ((exp_scores if kept is None else exp_scores * kept) @ value) / total
        weights = None
    if compute != dtype:
        output = xp.astype(output, dtype)
        weights = None if weights is None else xp.astype(weights, dtype)
    if not return_weights:
        return output
    if tuple(weights.shape[:-2]) != tuple(batch_shape):  # leading dimensions only value had
        weights = xp.broadcast_to(weights, (*batch_shape, n, m))
    return output, weights


def _empty_attention(xp: Any, query: Any, key: Any, value: Any, batch_shape: Any, return_weights: bool) -> Any:
    if batch_shape is None:
        batch_shape = _checks.leading_shape(query, key, value)
    n, m, device = query.shape[-2], key.shape[-2], _checks.device_of(query)
    output = xp.zeros((*batch_shape, n, value.shape[-1]), dtype=query.dtype, device=device)
    if not return_weights:
        return output
    return output, xp.zeros((*batch_shape, n, m), dtype=query.dtype, device=device)


def masked_softmax(
    scores: Array,
    *,
    mask: Array = None,
    key_lengths: Array = None,
    axis: int = -1,
    backend: str | None = None,
) -> Array:
    """Numerically stable softmax with attention masks.

    Parameters
    ----------
    scores : array, shape (..., n, m)
        Real floating scores; the softmax runs over ``axis`` (the keys).
    mask, key_lengths :
        As in :func:`scaled_dot_product_attention`, relative to ``scores``
        with ``axis`` moved last.
    axis : int
        The axis to normalise.

    Returns
    -------
    array, same shape and dtype as ``scores``
        Non-negative, summing to one along ``axis``; all zeros on a row
        where every entry is masked (scores of ``-inf`` mask too, as an
        additive mask's do).

    Raises
    ------
    TypeError
        If an input is not an array of a registered backend, the inputs come
        from two backends, or ``backend=`` does not own them.
        If ``scores`` is not real floating, ``mask`` is neither boolean
        nor of the scores' dtype, or ``key_lengths`` is not integer.
    ValueError
        If ``axis`` is out of range, ``mask`` does not broadcast to the
        scores, ``key_lengths`` has another shape, or (on concrete arrays) a
        length lies outside ``[0, m]`` or a real mask holds ``+inf`` or NaN.
        If ``backend=`` names no registered backend, or the inputs lie on
        two different devices.
    BackendUnavailableError
        If the backend that would run the call cannot run here (its library is
        not installed, or it has no device).

    Examples
    --------
    >>> import numpy as np
    >>> import attnx
    >>> scores = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    >>> print(attnx.masked_softmax(scores, key_lengths=np.array([2, 0])).round(3))
    [[0.269 0.731 0.   ]
     [0.    0.    0.   ]]
    >>> print(attnx.masked_softmax(scores, mask=np.array([True, True, False])).round(3))
    [[0.269 0.731 0.   ]
     [0.5   0.5   0.   ]]
    """
    operation = "masked_softmax"
    chosen, reason = _dispatch.resolve(
        operation, backend, ("scores", "mask", "key_lengths"), (scores, mask, key_lengths), 1
    )
    xp = chosen.xp
    _checks.require_ndim(operation, "scores", scores, 1, "(..., m)")
    _checks.require_float(operation, xp, "scores", scores)
    axis = _checks.require_int(operation, "axis", axis)
    if not -scores.ndim <= axis < scores.ndim:
        raise ValueError(f"{operation}: axis {axis} is out of range for scores with {scores.ndim} dimensions")
    shape = _checks.shape_of(scores)
    axis = axis % scores.ndim
    moved = shape[:axis] + shape[axis + 1 :] + (shape[axis],)
    if len(moved) == 1:
        moved = (1, *moved)
    batch_shape, n, m = moved[:-2], moved[-2], moved[-1]
    if scores.ndim == 1 and mask is not None and mask.ndim > 1:  # the (1, m) view is attnx's, not the user's
        raise ValueError(
            f"{operation}: mask must broadcast to the scores' shape ({m},), got shape {_checks.shape_of(mask)}"
        )
    _masking.check_masks(operation, xp, mask, key_lengths, batch_shape, n, m, scores_dtype=scores.dtype)
    return _dispatch.call(
        operation,
        chosen,
        reason,
        _masked_softmax_generic,
        {"scores": scores, "mask": mask, "key_lengths": key_lengths, "axis": axis},
    )


def _masked_softmax_generic(xp: Any, *, scores: Any, mask: Any, key_lengths: Any, axis: int) -> Any:
    ndim = scores.ndim
    dtype = scores.dtype
    compute = _checks.accumulation_dtype(xp, dtype)
    moved = xp.moveaxis(scores, axis, -1) if axis != ndim - 1 else scores
    if ndim == 1:
        moved = moved[None, :]
    if compute != dtype:
        moved = xp.astype(moved, compute)
    allowed, additive = _masking.combine(
        xp,
        mask=mask,
        key_lengths=key_lengths,
        is_causal=False,
        batch_shape=tuple(moved.shape[:-2]),
        n=moved.shape[-2],
        m=moved.shape[-1],
        dtype=compute,
        device=_checks.device_of(scores),
    )
    # The user's scores (or a view of them) unless the cast made a copy: never
    # overwritten.  Their own -inf masks, as an additive mask's would.
    weights = _masking.softmax(xp, moved, allowed, additive, owned=compute != dtype, scores_may_mask=True)
    if compute != dtype:
        weights = xp.astype(weights, dtype)
    if ndim == 1:
        weights = weights[0, :]
    return xp.moveaxis(weights, -1, axis) if axis != ndim - 1 else weights


def sdpa_chunked(
    xp: Any,
    *,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    query_chunk: int,
    key_chunk: int,
    batch_shape: tuple[int, ...] | None = None,
    map_blocks: Callable[..., list[Any]] | None = None,
    concurrent_blocks: int = 1,
    block_bytes: int = _tiling.BLOCK_BYTES,
    custom_vjp: Callable[..., Any] | None = None,
    dropout: _dropout.Dropout | None = None,
) -> Any:
    """Memory-efficient attention (Rabe and Staats 2021; the FlashAttention
    recurrence), array API only, walked by :func:`attnx._tiling.attend_tiles`
    (differentiated by its backward through ``custom_vjp``, the backend's
    :meth:`~attnx.Backend.custom_vjp`, where given).

    Queries are processed ``query_chunk`` rows at a time and keys
    ``key_chunk`` columns at a time, so the extra memory is
    O(query_chunk * key_chunk) per (batch, head) slice instead of O(n * m).
    Masks are built tile by tile; with ``is_causal`` the key tiles that lie
    wholly in a row range's future are never visited, and those wholly in
    its past are not masked.  The weights are not materialised.
    """
    if batch_shape is None:
        batch_shape = _checks.leading_shape(query, key, value)
    batch_shape = tuple(batch_shape)

    def plan(mask: Any, key_lengths: Any) -> tuple[_tiling.TilePlan, _tiling.TileScores]:
        return sdpa_tile_plan(
            xp,
            query,
            key,
            mask=mask,
            key_lengths=key_lengths,
            is_causal=is_causal,
            batch_shape=batch_shape,
            key_chunk=key_chunk,
        )

    walk = {
        "batch_shape": batch_shape,
        "query_chunk": query_chunk,
        "key_chunk": key_chunk,
        "map_blocks": map_blocks,
        "concurrent_blocks": concurrent_blocks,
        "block_bytes": block_bytes,
        "dropout": dropout,
    }
    if custom_vjp is None:
        tiles, tile_scores = plan(mask, key_lengths)
        return _tiling.attend_tiles(xp, query, key, value, scale=scale, tiles=tiles, tile_scores=tile_scores, **walk)
    real_mask = "mask" if mask is not None and _checks.is_float_dtype(xp, mask.dtype) else None
    return _tiling.attend_differentiable(
        custom_vjp,
        xp,
        query,
        key,
        value,
        scale=scale,
        plan=plan,
        masks={"mask": mask, "key_lengths": key_lengths},
        real_mask=real_mask,
        **walk,
    )


def sdpa_tile_plan(
    xp: Any,
    query: Any,
    key: Any,
    *,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    batch_shape: tuple[int, ...],
    key_chunk: int,
) -> tuple[_tiling.TilePlan, _tiling.TileScores]:
    """Which key tiles each range of rows visits, and each tile's masks: the
    one plan of the chunked forward and of its backward
    (:func:`attnx._tiling.backward_tiles`), so both skip and mask alike."""
    n, m = query.shape[-2], key.shape[-2]
    compute = _checks.accumulation_dtype(xp, query.dtype)
    device = _checks.device_of(query)

    def tiles(span: Any, rows: tuple[int, int]) -> Any:
        if is_causal:
            return _tiling.causal_tiles(m, rows, m - n, key_chunk)
        return _tiling.split(0, m, key_chunk, False)

    groups: dict[Any, tuple[Any, Any, tuple[int, ...]]] = {}  # per span: its mask, lengths and leading shape

    def group_masks(span: Any) -> tuple[Any, Any, tuple[int, ...]]:
        if span is None:
            return mask, key_lengths, batch_shape
        if span not in groups:  # sliced once per group, not once per tile
            groups[span] = (
                None if mask is None else _masking.batch_block(mask, len(batch_shape), 2, span),
                None if key_lengths is None else _masking.lengths_batch_block(key_lengths, batch_shape, n, span),
                (span[1] - span[0], *batch_shape[1:]),
            )
        return groups[span]

    def tile_scores(scores: Any, span: Any, rows: Any, cols: Any, masked: bool) -> tuple[Any, Any, Any]:
        group_mask, lengths, group_shape = group_masks(span)
        allowed, additive = _masking.combine(
            xp,
            mask=group_mask,
            key_lengths=lengths,
            is_causal=masked,
            batch_shape=group_shape,
            n=n,
            m=m,
            dtype=compute,
            device=device,
            rows=rows,
            cols=cols,
        )
        return scores, allowed, additive

    return tiles, tile_scores
