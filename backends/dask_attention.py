"""The Dask backend's natives: attention that follows the chunks.

Each task attends one chunk of queries (with its chunks of batch and
heads) over one chunk of keys and returns a partial state
(:mod:`attnx.blocks`): ``(..., rows, d_v + 2)``.  The states of a row of
key chunks are combined by ``dask.array.reduction``, a tree whose width is
Dask's ``split_every``, and each combined state is finished into the
output.  Tasks are pure functions of their chunks, named by Dask from what
they compute (so a worker lost mid-way is recomputed elsewhere, with the
same result).
"""

from __future__ import annotations

import string
from typing import Any

from array_api_compat import array_namespace

from attnx import blocks
from attnx.kernel_regression import combine_states_along, kernel_state
from attnx_backends import dask_namespace

#: Index names of the leading (batch, head, ...) axes in ``dask.array.blockwise``.
_BATCH = string.ascii_uppercase


def scaled_dot_product_attention(
    *,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    return_weights: bool,
    chunks: Any = None,
    batch_shape: Any = None,
    chunk_size: Any = None,
) -> Any:
    if return_weights or query.shape[-2] == 0 or key.shape[-2] == 0:
        return NotImplemented  # the generic algorithm builds the (lazy) weights, and the zeros of an empty call
    blocks_of = _Blocks(query, key, value, mask, key_lengths, is_causal, scale, batch_shape, chunk_size, chunks)
    return _finish(blocks_of.state(), query.dtype)


def scaled_dot_product_attention_vjp(
    *,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    chunks: Any,
    batch_shape: Any,
    chunk_size: Any,
) -> Any:
    """``vjp(scaled_dot_product_attention)`` that follows the chunks: the
    forward's combined states (one a row) are kept, lazily; each block of
    queries and keys gives its parts of the gradients from them
    (:func:`attnx.blocks.attend_block_vjp`), the queries' summed over the
    key chunks and the keys' and values' over the query chunks, both in a
    tree.  A real mask (whose gradient attnx's backward gives) and an empty
    call go to attnx's tiled backward."""
    if query.shape[-2] == 0 or key.shape[-2] == 0 or (mask is not None and mask.dtype != bool):
        return NotImplemented
    blocks_of = _Blocks(query, key, value, mask, key_lengths, is_causal, scale, batch_shape, chunk_size, chunks)
    state = blocks_of.state()
    return _finish(state, query.dtype), lambda cotangent: blocks_of.gradients(state, cotangent)


class _Blocks:
    """A call's arrays and masks as ``dask.array.blockwise`` takes them:
    queries by ``i``, keys by ``j``, the leading axes by letters of their own."""

    def __init__(
        self,
        query: Any,
        key: Any,
        value: Any,
        mask: Any,
        key_lengths: Any,
        is_causal: bool,
        scale: Any,
        batch_shape: Any,
        chunk_size: Any,
        chunks: Any,
    ) -> None:
        import dask.array as da

        n, m = query.shape[-2], key.shape[-2]
        self.ndim = ndim = len(batch_shape) + 2
        self.batch = batch = tuple(_BATCH[: len(batch_shape)])
        query, key, value = (_leading_axes(a, ndim) for a in (query, key, value))
        if chunk_size is not None:  # the user's blocks: chunks of queries and keys
            query_chunk, key_chunk = chunks
            query = dask_namespace.rechunk(query, {ndim - 2: query_chunk})
            key, value = (dask_namespace.rechunk(a, {ndim - 2: key_chunk}) for a in (key, value))
        self.query, self.key, self.value = query, key, dask_namespace.rechunk(value, {ndim - 1: -1})
        masks = []
        if key_lengths is not None:
            # The keys' positions in chunks of the lengths' own kind (CuPy's on
            # GPU workers), cut as the keys are.
            positions = dask_namespace.arange(m, device=dask_namespace.device(key_lengths), chunks=(key.chunks[-2],))
            masks.append(blocks.lengths_mask(key_lengths, batch_shape, n, m, positions=positions))
        masks += [] if mask is None else [mask]
        self.rest: list[Any] = []  # after the arrays: the masks, the causal positions, a 0-d scale
        for one in masks:
            self.rest += [_leading_axes(one, ndim), (*batch, "i", "j")]
        if is_causal:  # each task learns its place from chunks of positions
            self.rest += [
                da.arange(n, chunks=(query.chunks[-2],)),
                ("i",),
                da.arange(m, chunks=(key.chunks[-2],)),
                ("j",),
            ]
        if not isinstance(scale, float):  # a 0-d array
            self.rest += [scale, ()]
        self.compute = blocks.state_dtype(array_namespace(query), query.dtype)
        self.options = {
            "mask_count": len(masks),
            "is_causal": is_causal,
            "scale": scale if isinstance(scale, float) else None,
            "scores_shape": (n, m) if is_causal else None,
        }

    def state(self) -> Any:
        """Every row's state over all keys ``(..., n, d_v + 2)``: the key
        chunks' states combined in a tree."""
        import dask.array as da

        batch, ndim = self.batch, self.ndim
        partials = da.blockwise(
            _attend,
            (*batch, "i", "j", "e"),
            self.query,
            (*batch, "i", "k"),
            self.key,
            (*batch, "j", "k"),
            self.value,
            (*batch, "j", "e"),
            *self.rest,
            adjust_chunks={"j": 1, "e": lambda size: size + 2},
            concatenate=True,
            dtype=self.compute,
            meta=da.utils.meta_from_array(self.query, ndim=ndim + 1, dtype=self.compute),
            token="attnx-sdpa-block",
            **self.options,
        )
        return _combine_keys(partials, ndim - 1)

    def gradients(self, state: Any, cotangent: Any) -> tuple[Any, Any, Any, Any]:
        """``(d_query, d_key, d_value, d_scale)`` over the leading shape, from
        the rows' ``state`` and the output's ``cotangent``."""
        import dask.array as da

        batch, ndim = self.batch, self.ndim
        d_k, d_v = self.query.shape[-1], self.value.shape[-1]
        query = dask_namespace.rechunk(self.query, {ndim - 1: -1})
        key = dask_namespace.rechunk(self.key, {ndim - 1: -1})
        # The cotangent and the states cut as the queries are.
        row_chunks = {ndim - 2: query.chunks[-2]}
        d_output = dask_namespace.rechunk(_leading_axes(cotangent, ndim), {**row_chunks, ndim - 1: -1})
        state = dask_namespace.rechunk(state, {**row_chunks, ndim - 1: -1})
        arrays = [
            query,
            (*batch, "i", "k"),
            key,
            (*batch, "j", "k"),
            self.value,
            (*batch, "j", "e"),
            d_output,
            (*batch, "i", "e"),
            state,
            (*batch, "i", "s"),
            *self.rest,
        ]
        meta = da.utils.meta_from_array(query, ndim=ndim + 1, dtype=self.compute)
        # The rows' parts, one a key chunk: d_query and the scale's gradient side by side.
        rows = da.blockwise(
            _rows_part,
            (*batch, "i", "j", "g"),
            *arrays,
            new_axes={"g": d_k + 1},
            adjust_chunks={"j": 1},
            concatenate=True,
            dtype=self.compute,
            meta=meta,
            token="attnx-sdpa-vjp-rows",
            **self.options,
        )
        # The keys' parts, one a query chunk: d_key and d_value side by side.
        keys = da.blockwise(
            _keys_part,
            (*batch, "i", "j", "f"),
            *arrays,
            new_axes={"f": d_k + d_v},
            adjust_chunks={"i": 1},
            concatenate=True,
            dtype=self.compute,
            meta=meta,
            token="attnx-sdpa-vjp-keys",
            **self.options,
        )
        rows = da.sum(rows, axis=ndim - 1)  # over the key chunks, in a tree
        keys = da.sum(keys, axis=ndim - 2)  # over the query chunks, in a tree
        d_scale = da.sum(rows[..., d_k])
        return rows[..., :d_k], keys[..., :d_k], keys[..., d_k:], d_scale


def _attend(
    query: Any,
    key: Any,
    value: Any,
    *rest: Any,
    mask_count: int,
    is_causal: bool,
    scale: float | None,
    scores_shape: tuple[int, int] | None,
) -> Any:
    masks, offset, scale = _place(rest, mask_count, is_causal, scale)
    state = blocks.attend_block(
        query, key, value, scale=scale, mask=masks, is_causal=is_causal, offset=offset, scores_shape=scores_shape
    )
    return state[..., None, :]


def _place(rest: tuple[Any, ...], mask_count: int, is_causal: bool, scale: float | None) -> tuple[Any, Any, Any]:
    """``(masks, offset, scale)`` of a block from the arrays after its
    query, key and value (:class:`_Blocks`' ``rest``): its masks, its first
    query and key in the whole scores (read from its chunks of positions
    where causal), and the scale (a 0-d array's, where ``scale`` is None)."""
    masks, rest = rest[:mask_count], rest[mask_count:]
    offset = (0, 0)
    if is_causal:
        (rows, cols), rest = rest[:2], rest[2:]
        offset = (int(rows[0]), int(cols[0])) if rows.shape[0] and cols.shape[0] else (0, 0)
    if scale is None:
        (scale,) = rest
    return masks, offset, scale


def _block_gradients(
    query: Any,
    key: Any,
    value: Any,
    d_output: Any,
    state: Any,
    *rest: Any,
    mask_count: int,
    is_causal: bool,
    scale: float | None,
    scores_shape: tuple[int, int] | None,
) -> tuple[Any, Any, Any, Any]:
    """:func:`attnx.blocks.attend_block_vjp` of one block, its place read
    as :func:`_attend` reads it."""
    masks, offset, scale = _place(rest, mask_count, is_causal, scale)
    return blocks.attend_block_vjp(
        query,
        key,
        value,
        d_output,
        state,
        scale=scale,
        mask=masks,
        is_causal=is_causal,
        offset=offset,
        scores_shape=scores_shape,
    )


def _rows_part(*arrays: Any, **options: Any) -> Any:
    d_query, _, _, d_scale = _block_gradients(*arrays, **options)
    return array_namespace(d_query).concat([d_query, d_scale], axis=-1)[..., None, :]


def _keys_part(*arrays: Any, **options: Any) -> Any:
    _, d_key, d_value, _ = _block_gradients(*arrays, **options)
    return array_namespace(d_key).concat([d_key, d_value], axis=-1)[..., None, :, :]


def nadaraya_watson(*, queries: Any, keys: Any, values: Any, kernel: Any, bandwidth: Any, return_weights: bool) -> Any:
    if return_weights or queries.shape[0] == 0 or keys.shape[0] == 0:
        return NotImplemented
    import dask.array as da

    features = ("k",) if keys.ndim == 2 else ()
    columns = dask_namespace.rechunk(values if values.ndim == 2 else values[:, None], {1: -1})
    arguments: list[Any] = [queries, ("i", *features), keys, ("j", *features), columns, ("j", "e")]
    if not isinstance(bandwidth, float):  # a 0-d array
        arguments += [bandwidth, ()]
    compute = blocks.state_dtype(array_namespace(queries), queries.dtype)
    # The gaussian's states carry each query's nearest key, so that queries
    # beyond the float range in bandwidths combine exactly (combine_states_along).
    # One key chunk too: the reduction combines even a lone state, and
    # blocks.combine_along turns one whose scores are all -inf into zeros.
    with_nearest = kernel == "gaussian"
    partials = da.blockwise(
        _kernel_block,
        ("i", "j", "e"),
        *arguments,
        adjust_chunks={"j": 1, "e": lambda size: size + 2 + with_nearest},
        concatenate=True,
        dtype=compute,
        meta=da.utils.meta_from_array(queries, ndim=3, dtype=compute),
        token="attnx-nadaraya-watson-block",
        kernel=kernel,
        bandwidth=bandwidth if isinstance(bandwidth, float) else None,
        with_nearest=with_nearest,
    )
    combined = _combine_keys(partials, 1, _combine_with_nearest if with_nearest else _combine)
    estimate = _finish(combined[..., :-1] if with_nearest else combined, queries.dtype)
    return estimate if values.ndim == 2 else estimate[:, 0]


def _kernel_block(
    queries: Any, keys: Any, values: Any, *rest: Any, kernel: Any, bandwidth: float | None, with_nearest: bool
) -> Any:
    if bandwidth is None:
        (bandwidth,) = rest
    if not with_nearest:
        return kernel_state(queries, keys, values, kernel=kernel, bandwidth=bandwidth)[:, None, :]
    state, nearest = kernel_state(queries, keys, values, kernel=kernel, bandwidth=bandwidth, return_nearest=True)
    return array_namespace(state).concat([state, nearest[:, None]], axis=-1)[:, None, :]


def causal_conv1d(*, x: Any, weight: Any, bias: Any, stride: int, dilation: int) -> Any:
    """Each task convolves one chunk of the leading axes, with every channel
    and the whole sequence (its chunks joined in the task): the leading
    sizes may be unknown (after a boolean selection), which joining the
    padding to the whole array could not allow."""
    import dask.array as da

    import attnx

    lead = tuple(_BATCH[: x.ndim - 2])
    out_length = -(-x.shape[-1] // stride)
    arguments: list[Any] = [x, (*lead, "c", "l"), weight, ("o", "c", "k")]
    if bias is not None:
        arguments += [bias, ("o",)]
    return da.blockwise(
        _convolve,
        (*lead, "o", "t"),
        *arguments,
        new_axes={"t": out_length},
        concatenate=True,
        dtype=x.dtype,
        meta=da.utils.meta_from_array(x, ndim=x.ndim),
        token="attnx-causal-conv1d",
        stride=stride,
        dilation=dilation,
        convolve=attnx.causal_conv1d,
    )


def _convolve(x: Any, weight: Any, bias: Any = None, *, stride: int, dilation: int, convolve: Any) -> Any:
    return convolve(x, weight, bias, stride=stride, dilation=dilation)  # attnx on the chunks' own backend


def _combine_keys(partials: Any, axis: int, combine: Any = None) -> Any:
    """The states of every key chunk combined: a tree reduction over ``axis``
    (``combine``: :func:`_combine` by default)."""
    import dask.array as da

    combine = combine or _combine
    return da.reduction(
        partials,
        chunk=_each,
        combine=combine,
        aggregate=combine,
        axis=axis,
        keepdims=False,
        concatenate=True,
        dtype=partials.dtype,
        meta=da.utils.meta_from_array(partials, ndim=partials.ndim - 1),
        name="attnx-combine",
    )


def _each(state: Any, axis: Any, keepdims: bool) -> Any:
    return state  # one state per chunk already


def _combine(states: Any, axis: Any, keepdims: bool) -> Any:
    (axis,) = axis
    return blocks.combine_along(states, axis, keepdims=keepdims)


def _combine_with_nearest(states: Any, axis: Any, keepdims: bool) -> Any:
    """:func:`_combine` of kernel states whose last column is the nearest key's distance."""
    (axis,) = axis
    state, nearest = combine_states_along(states[..., :-1], states[..., -1], axis, keepdims=keepdims)
    return array_namespace(state).concat([state, nearest[..., None]], axis=-1)


def _finish(state: Any, dtype: Any) -> Any:
    """The output of each combined state, in the inputs' dtype."""
    chunks = (*state.chunks[:-1], (state.shape[-1] - 2,))
    return state.map_blocks(_finish_block, dtype=dtype, chunks=chunks, output_dtype=dtype, token="attnx-finish")


def _finish_block(state: Any, output_dtype: Any) -> Any:
    return blocks.finish(state, dtype=output_dtype)


def _leading_axes(array: Any, ndim: int) -> Any:
    """``array`` with size-1 axes in front up to ``ndim`` axes (blockwise
    broadcasts them)."""
    return array[(None,) * (ndim - array.ndim)] if array.ndim < ndim else array
