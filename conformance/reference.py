"""float64 NumPy references, written straight from the formulas.

Deliberately independent of attnx: each rule written out in plain NumPy
(the causal rule, the key lengths, the softmax), no code shared with the
algorithms under test.
"""

from __future__ import annotations

import math

import numpy as np


def allowed_mask(
    n: int,
    m: int,
    *,
    batch_shape: tuple[int, ...] = (),
    mask: np.ndarray | None = None,
    key_lengths: np.ndarray | None = None,
    lengths_per: str = "sequence",
    is_causal: bool = False,
    causal_align: str = "bottom_right",
) -> np.ndarray:
    """Boolean (*batch_shape, n, m), True where query i may attend key j.

    ``lengths_per`` says how ``key_lengths`` is laid out: ``"batch"`` (one per
    first leading index), ``"sequence"`` (the leading shape) or ``"query"``.
    ``causal_align="key_lengths"``: the last query sees the last of its own
    ``key_lengths`` keys, ``j <= i + (length - n)``.
    """
    i, j = np.arange(n)[:, None], np.arange(m)[None, :]  # query i, key j
    allowed = np.ones((*batch_shape, n, m), dtype=bool)
    if is_causal and causal_align == "bottom_right":
        allowed &= j <= i + (m - n)  # the last query sees every key
    if key_lengths is not None:
        key_lengths = np.asarray(key_lengths)
        if lengths_per == "batch":
            length = key_lengths.reshape(-1, *(1,) * len(batch_shape[1:]), 1, 1)
        elif lengths_per == "query":
            length = np.broadcast_to(key_lengths, (*batch_shape, n))[..., None]
        else:
            length = np.broadcast_to(key_lengths, batch_shape)[..., None, None]
        allowed &= j < length
        if is_causal and causal_align == "key_lengths":
            allowed &= j <= i + (length - n)
    if mask is not None and mask.dtype == bool:
        allowed &= np.broadcast_to(mask, allowed.shape)
    return allowed


def softmax(scores: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
    """Row softmax over the last axis; entries not allowed (or -inf) get 0, and
    a row with nothing allowed is all zeros."""
    scores = np.asarray(scores, dtype=np.float64)
    if allowed is None:
        allowed = np.ones(scores.shape, dtype=bool)
    allowed = np.broadcast_to(allowed, scores.shape) & (scores != -np.inf)
    # Each row shifted by the largest score it may attend (0 where it may attend none).
    largest = np.max(np.where(allowed, scores, -np.inf), axis=-1, keepdims=True, initial=-np.inf)
    shifted = np.where(allowed, scores - np.where(allowed.any(axis=-1, keepdims=True), largest, 0.0), -np.inf)
    exponentials = np.exp(shifted)
    total = exponentials.sum(axis=-1, keepdims=True)
    return np.where(total > 0, exponentials / np.where(total > 0, total, 1.0), 0.0)


def _lowbias32(words: np.ndarray) -> np.ndarray:
    """Chris Wellons' lowbias32 integer hash, on unsigned 32-bit words."""
    words = np.atleast_1d(np.asarray(words, dtype=np.uint32))  # arrays wrap silently, scalars warn
    words = words ^ (words >> np.uint32(16))
    words = words * np.uint32(0x7FEB352D)
    words = words ^ (words >> np.uint32(15))
    words = words * np.uint32(0x846CA68B)
    return words ^ (words >> np.uint32(16))


def dropout_multiplier(seed: int, batch_shape: tuple[int, ...], n: int, m: int, p: float) -> np.ndarray:
    """attnx's dropout mask (*batch_shape, n, m) as its contract states it:
    ``0`` where dropped, ``1 / (1 - p)`` where kept, kept where
    ``mix(mix(key ^ i) ^ mix(j ^ 0x9E3779B9)) >= round(p * 2**32)`` with
    ``key = mix(mix(seed mod 2**32) ^ slice)``, ``slice`` the row-major
    index into ``batch_shape``."""
    slices = np.arange(math.prod(batch_shape), dtype=np.uint32).reshape(batch_shape)
    key = _lowbias32(_lowbias32(np.uint32(seed % 2**32)) ^ slices).reshape(batch_shape)
    row = _lowbias32(key[..., None, None] ^ np.arange(n, dtype=np.uint32)[:, None])
    column = _lowbias32(np.arange(m, dtype=np.uint32)[None, :] ^ np.uint32(0x9E3779B9))
    kept = _lowbias32(row ^ column).astype(np.int64) >= round(p * 2**32)
    return np.where(kept, 1.0 / (1.0 - p) if p < 1 else 0.0, 0.0)


def scaled_dot_product_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    *,
    allowed: np.ndarray | None = None,
    additive: np.ndarray | None = None,
    scale: float | None = None,
    dropout: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """softmax(q k^T * scale + additive) v with the allowed mask, the
    weights multiplied by ``dropout`` (:func:`dropout_multiplier`) where
    given; (output, weights after dropout)."""
    query, key, value = (np.asarray(a, dtype=np.float64) for a in (query, key, value))
    lead = np.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    query, key, value = (np.broadcast_to(a, (*lead, *a.shape[-2:])) for a in (query, key, value))
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    scores = np.einsum("...nd,...md->...nm", query, key) * scale
    if additive is not None:
        scores = scores + np.asarray(additive, dtype=np.float64)
    weights = softmax(scores, allowed)
    if dropout is not None:
        weights = weights * dropout
    return np.einsum("...nm,...md->...nd", weights, value), weights


def scaled_dot_product_attention_vjp(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    cotangent: np.ndarray,
    *,
    allowed: np.ndarray | None = None,
    additive: np.ndarray | None = None,
    scale: float | None = None,
    dropout: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The cotangents of ``query``, ``key``, ``value``, ``scale`` (and an
    ``additive`` mask's) for ``cotangent`` of the output, from the chain
    rule on the dense formula: ``dV = (P Z)^T dO``, ``dS = P * (Z dO V^T -
    rowsum(dO * O))``, ``dQ = s dS K``, ``dK = s dS^T Q``, ``d_scale =
    sum(dS * Q K^T)``, ``d_additive = dS``, with ``Z`` the ``dropout``
    multiplier (1 without); each summed over the axes its argument was
    broadcast along."""
    shapes = {"query": np.shape(query), "key": np.shape(key), "value": np.shape(value)}
    if additive is not None:
        shapes["additive"] = np.shape(additive)
    query, key, value, cotangent = (np.asarray(a, dtype=np.float64) for a in (query, key, value, cotangent))
    lead = np.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    query, key, value = (np.broadcast_to(a, (*lead, *a.shape[-2:])) for a in (query, key, value))
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    output, weights = scaled_dot_product_attention(query, key, value, allowed=allowed, additive=additive, scale=scale)
    multiplier = 1.0 if dropout is None else dropout
    output = np.einsum("...nm,...md->...nd", weights * multiplier, value)
    d_weights = np.einsum("...nd,...md->...nm", cotangent, value) * multiplier
    d_scores = weights * (d_weights - np.sum(cotangent * output, axis=-1, keepdims=True))
    unscaled = np.einsum("...nd,...md->...nm", query, key)
    grads = {
        "query": scale * np.einsum("...nm,...md->...nd", d_scores, key),
        "key": scale * np.einsum("...nm,...nd->...md", d_scores, query),
        "value": np.einsum("...nm,...nd->...md", weights * multiplier, cotangent),
        "additive": d_scores,
    }
    for name, shape in shapes.items():
        grad = grads[name]
        grad = grad.sum(axis=tuple(range(grad.ndim - len(shape))))
        grads[name] = grad.sum(axis=tuple(i for i, size in enumerate(shape) if size == 1), keepdims=True)
    grads["scale"] = np.asarray(np.sum(d_scores * unscaled))
    return grads


def multi_head_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    params: dict,
    num_heads: int,
    num_kv_heads: int | None = None,
    allowed: np.ndarray | None = None,
    add_zero_attn: bool = False,
    additive: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Head by head: (output, weights per head (..., h, n, m')).  ``allowed``
    (and a real ``additive`` mask, added to the scores) broadcasts to (...,
    n, m) or (..., h, n, m).  ``params["bias_k"]`` and
    ``["bias_v"]`` append one key/value row after the projections, and
    ``add_zero_attn`` a row of zeros to every head: m' = m + 1 or m + 2,
    those keys attended by every query."""
    p = {name: np.asarray(value_, dtype=np.float64) for name, value_ in params.items()}
    h = num_heads
    h_kv = num_kv_heads or h
    q = query @ p["w_q"] + p.get("b_q", 0.0)
    k = key @ p["w_k"] + p.get("b_k", 0.0)
    v = value @ p["w_v"] + p.get("b_v", 0.0)
    extra = 0
    if "bias_k" in p:
        k = np.concatenate([k, np.broadcast_to(p["bias_k"], (*k.shape[:-2], 1, k.shape[-1]))], axis=-2)
        v = np.concatenate([v, np.broadcast_to(p["bias_v"], (*v.shape[:-2], 1, v.shape[-1]))], axis=-2)
        extra += 1
    if add_zero_attn:  # zeros in every head: a zero row of the concatenated heads
        k = np.concatenate([k, np.zeros((*k.shape[:-2], 1, k.shape[-1]))], axis=-2)
        v = np.concatenate([v, np.zeros((*v.shape[:-2], 1, v.shape[-1]))], axis=-2)
        extra += 1
    if allowed is not None and extra:
        allowed = np.concatenate([allowed, np.ones((*allowed.shape[:-1], extra), dtype=bool)], axis=-1)
    if additive is not None and extra:
        additive = np.concatenate([additive, np.zeros((*additive.shape[:-1], extra))], axis=-1)
    d_k, d_v = q.shape[-1] // h, v.shape[-1] // h_kv
    # A per-head mask has the inputs' broadcast leading dimensions, then (h, n, m):
    # counted from all three inputs, as key or value may have more than query.
    per_head_ndim = max(query.ndim, key.ndim, value.ndim) - 2 + 3
    heads, weights = [], []
    for i in range(h):
        j = i // (h // h_kv)
        head_allowed, head_additive = (
            mask[..., i, :, :] if mask is not None and mask.ndim == per_head_ndim and mask.shape[-3] == h else mask
            for mask in (allowed, additive)
        )
        out, w = scaled_dot_product_attention(
            q[..., i * d_k : (i + 1) * d_k],
            k[..., j * d_k : (j + 1) * d_k],
            v[..., j * d_v : (j + 1) * d_v],
            allowed=head_allowed,
            additive=head_additive,
        )
        heads.append(out)
        weights.append(w)
    concat = np.concatenate(heads, axis=-1)
    output = concat @ p["w_o"] + p.get("b_o", 0.0) if "w_o" in p else concat
    return output, np.stack(weights, axis=-3)


def additive_attention(query, key, value, params, allowed=None, bias=None):
    """Score by score: a(q_i, k_j) = w_v . tanh(W_q^T q_i + W_k^T k_j), plus
    ``bias`` (a real mask's finite entries) where given."""
    w_q, w_k, w_v = (np.asarray(params[n], dtype=np.float64) for n in ("w_q", "w_k", "w_v"))
    query, key, value = (np.asarray(a, np.float64) for a in (query, key, value))
    lead = np.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    query = np.broadcast_to(query, (*lead, *query.shape[-2:]))
    key = np.broadcast_to(key, (*lead, *key.shape[-2:]))
    value = np.broadcast_to(value, (*lead, *value.shape[-2:]))
    n, m = query.shape[-2], key.shape[-2]
    scores = np.zeros((*lead, n, m))
    for index in np.ndindex(*lead, n, m):
        *b, i, j = index
        scores[index] = w_v @ np.tanh(query[(*b, i)] @ w_q + key[(*b, j)] @ w_k)
    if bias is not None:
        scores = scores + bias
    weights = softmax(scores, allowed)
    return np.einsum("...nm,...md->...nd", weights, value), weights


KERNELS = {
    "gaussian": lambda u: math.exp(-u * u / 2),
    "boxcar": lambda u: 1.0 if abs(u) <= 1 else 0.0,
    "epanechnikov": lambda u: 0.75 * (1 - u * u) if abs(u) <= 1 else 0.0,
}


def nadaraya_watson(queries, keys, values, kernel="gaussian", bandwidth=1.0):
    queries, keys, values = (np.asarray(a, dtype=np.float64) for a in (queries, keys, values))
    K = KERNELS[kernel] if isinstance(kernel, str) else kernel
    weights = np.zeros((len(queries), len(keys)))
    for i, q in enumerate(queries):
        for j, k in enumerate(keys):
            weights[i, j] = K(float(np.linalg.norm(np.atleast_1d(q - k))) / bandwidth)
        total = weights[i].sum()
        if total > 0:
            weights[i] /= total
    return np.tensordot(weights, values, axes=(1, 0)), weights


def sinusoidal_positions(num_positions, dim, base=10000.0):
    table = np.zeros((num_positions, dim))
    for i in range(num_positions):
        for column in range(dim):
            j = column // 2
            angle = i / base ** (2 * j / dim)
            table[i, column] = math.sin(angle) if column % 2 == 0 else math.cos(angle)
    return table


def apply_rotary(x, positions=None, base=10000.0, interleaved=True):
    """RoPE: each pair (x_2j, x_2j+1) rotated by p * base^(-2j/d), a 2x2
    rotation at a time; ``interleaved=False``: :func:`apply_rotary_halves`."""
    if not interleaved:
        return apply_rotary_halves(x, positions, base)
    x = np.asarray(x, dtype=np.float64)
    n, d = x.shape[-2:]
    positions = np.arange(n) if positions is None else np.asarray(positions, dtype=np.float64)
    positions = np.broadcast_to(positions, (*x.shape[:-2], n))
    out = np.empty_like(x)
    for index in np.ndindex(*x.shape[:-1]):
        p = positions[index]
        for j in range(d // 2):
            theta = p * base ** (-2 * j / d)
            rotation = np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
            out[(*index, slice(2 * j, 2 * j + 2))] = rotation @ x[(*index, slice(2 * j, 2 * j + 2))]
    return out


def apply_rotary_halves(x, positions=None, base=10000.0):
    """RoPE in GPT-NeoX's layout, as Hugging Face transformers writes it for
    LLaMA: ``x * cos(emb) + rotate_half(x) * sin(emb)``, where ``emb`` is the
    angles ``p * base^(-2j/d)`` repeated for both halves and ``rotate_half(x)
    = concat(-x[d/2:], x[:d/2])``."""
    x = np.asarray(x, dtype=np.float64)
    n, d = x.shape[-2:]
    positions = np.arange(n) if positions is None else np.asarray(positions, dtype=np.float64)
    inverse_frequencies = 1.0 / base ** (np.arange(0, d, 2) / d)
    angles = positions[..., None] * inverse_frequencies
    emb = np.concatenate([angles, angles], axis=-1)
    rotate_half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


def causal_conv1d(x, weight, bias=None, stride=1, dilation=1):
    """y[..., o, t] = b[o] + sum_{c,i} w[o, c, i] x[..., c, t*stride - (K-1-i)*dilation] (zero before 0)."""
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    c_out, c_in, kernel_size = weight.shape
    length = x.shape[-1]
    out_length = -(-length // stride)
    y = np.zeros((*x.shape[:-2], c_out, out_length))
    for t in range(out_length):
        for i in range(kernel_size):
            source = t * stride - (kernel_size - 1 - i) * dilation
            if source >= 0:
                y[..., :, t] += x[..., :, source] @ weight[:, :, i].T
    if bias is not None:
        y += np.asarray(bias, np.float64)[:, None]
    return y


def flex_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    *,
    score: object = None,
    allowed: np.ndarray | None = None,
    scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """FlexAttention from its definition: query head ``h`` reads key/value
    head ``h // (H // H_kv)``; ``score(scores, b, h, i, j)`` (a function of
    the full score array and index grids) changes the scaled scores; the
    ``allowed`` (B, H, n, m) mask applies after.  Returns (output, weights)."""
    query, key, value = (np.asarray(a, dtype=np.float64) for a in (query, key, value))
    (batch,) = np.broadcast_shapes(query.shape[:1], key.shape[:1], value.shape[:1])
    _, heads, n, d = query.shape
    query = np.broadcast_to(query, (batch, *query.shape[1:]))
    group = heads // key.shape[1]
    key = np.broadcast_to(np.repeat(key, group, axis=1), (batch, heads, *key.shape[2:]))
    value = np.broadcast_to(np.repeat(value, group, axis=1), (batch, heads, *value.shape[2:]))
    scores = np.einsum("bhnd,bhmd->bhnm", query, key) * (1.0 / math.sqrt(d) if scale is None else scale)
    if score is not None:
        b, h, i, j = np.meshgrid(
            np.arange(batch), np.arange(heads), np.arange(n), np.arange(key.shape[2]), indexing="ij"
        )
        scores = score(scores, b, h, i, j)
    weights = softmax(scores, allowed)
    return np.einsum("bhnm,bhmd->bhnd", weights, value), weights


#: Each named kernel's derivative in t = u^2, as a function of t.
KERNEL_SLOPES = {
    "gaussian": lambda t: -0.5 * np.exp(-t / 2),
    "boxcar": lambda t: np.zeros_like(t),
    "epanechnikov": lambda t: np.where(t < 1, -0.75, 0.0),
}


def nadaraya_watson_vjp(queries, keys, values, cotangent, kernel="gaussian", bandwidth=1.0):
    """The cotangents of ``queries``, ``keys``, ``values`` and ``bandwidth``
    from the chain rule on the dense formula, with each kernel a function of
    ``t = (|q - k| / b)^2``: ``w = K(t) / Z``, ``dK = (g . v - g . f) / Z``,
    ``dt = dK K'(t)``, ``dq = sum_j dt 2 (q - k_j) / b^2``, ``dk = -sum_i dt
    2 (q_i - k) / b^2``, ``db = sum dt (-2 t / b)``, ``dv = w^T g``."""
    scalar_positions, scalar_values = np.ndim(keys) == 1, np.ndim(values) == 1
    q, k = (np.asarray(a, dtype=np.float64).reshape(len(a), -1) for a in (queries, keys))
    v, g = (np.asarray(a, dtype=np.float64).reshape(len(a), -1) for a in (values, cotangent))
    difference = q[:, None, :] - k[None, :, :]  # (n, m, d)
    t = (difference**2).sum(-1) / bandwidth**2
    kernel_values = np.vectorize(lambda u: KERNELS[kernel](u))(np.sqrt(t))
    totals = kernel_values.sum(-1, keepdims=True)
    totals = np.where(totals == 0, 1.0, totals)
    weights = kernel_values / totals
    estimate = weights @ v
    d_kernel = (g @ v.T - (g * estimate).sum(-1, keepdims=True)) / totals
    d_t = d_kernel * KERNEL_SLOPES[kernel](t)
    d_queries = (d_t[:, :, None] * 2 * difference / bandwidth**2).sum(1)
    d_keys = -(d_t[:, :, None] * 2 * difference / bandwidth**2).sum(0)
    grads = {
        "queries": d_queries[:, 0] if scalar_positions else d_queries,
        "keys": d_keys[:, 0] if scalar_positions else d_keys,
        "values": (weights.T @ g)[:, 0] if scalar_values else weights.T @ g,
        "bandwidth": float((d_t * (-2 * t / bandwidth)).sum()),
    }
    return grads


def causal_conv1d_vjp(x, weight, cotangent, bias=None, stride=1, dilation=1):
    """The cotangents of ``x``, ``weight`` (and ``bias``) of
    :func:`causal_conv1d`, by the chain rule on its sum: each output ``t``
    and tap ``i`` reading ``x[..., :, source]`` sends ``g[..., :, t] @
    w[:, :, i]`` back to that source and ``g[..., :, t] x[..., :, source]``
    to ``w[:, :, i]``."""
    x, weight, g = (np.asarray(a, np.float64) for a in (x, weight, cotangent))
    kernel_size = weight.shape[-1]
    d_x, d_weight = np.zeros_like(x), np.zeros_like(weight)
    for t in range(g.shape[-1]):
        for i in range(kernel_size):
            source = t * stride - (kernel_size - 1 - i) * dilation
            if source >= 0:
                d_x[..., :, source] += g[..., :, t] @ weight[:, :, i]
                rows_g, rows_x = g[..., :, t].reshape(-1, g.shape[-2]), x[..., :, source].reshape(-1, x.shape[-2])
                d_weight[:, :, i] += rows_g.T @ rows_x  # summed over the leading axes
    grads = {"x": d_x, "weight": d_weight}
    if bias is not None:
        grads["bias"] = g.sum(axis=(*range(g.ndim - 2), g.ndim - 1))
    return grads


def apply_rotary_vjp(x, cotangent, positions=None, base=10000.0, interleaved=True):
    """The cotangents of ``x`` and (real) ``positions`` of RoPE, a pair at a
    time from the inputs: ``(a, b)`` turned by ``theta`` gives back ``da = g_a
    cos + g_b sin``, ``db = -g_a sin + g_b cos``, and ``dtheta = g_a (-a sin
    - b cos) + g_b (a cos - b sin)``, times the pair's frequency for its
    position."""
    x, g = np.asarray(x, np.float64), np.asarray(cotangent, np.float64)
    n, d = x.shape[-2:]
    p = np.arange(n, dtype=np.float64) if positions is None else np.asarray(positions, np.float64)
    p_full = np.broadcast_to(p, (*x.shape[:-2], n))
    half = d // 2
    pairs = [(2 * j, 2 * j + 1) if interleaved else (j, j + half) for j in range(half)]
    d_x, d_p = np.zeros_like(x), np.zeros(p_full.shape)
    for j, (first, second) in enumerate(pairs):
        frequency = base ** (-2 * j / d)
        theta = p_full * frequency
        cos, sin = np.cos(theta), np.sin(theta)
        a, b, g_a, g_b = x[..., first], x[..., second], g[..., first], g[..., second]
        d_x[..., first] = g_a * cos + g_b * sin
        d_x[..., second] = -g_a * sin + g_b * cos
        d_p += (g_a * (-a * sin - b * cos) + g_b * (a * cos - b * sin)) * frequency
    # Summed over the axes the positions were broadcast along.
    extra = d_p.ndim - p.ndim
    d_p = d_p.sum(axis=tuple(range(extra)))
    d_p = d_p.sum(axis=tuple(axis for axis, size in enumerate(p.shape) if size == 1), keepdims=True)
    return {"x": d_x, "positions": d_p.reshape(p.shape)}


def learned_positions_vjp(count, positions, cotangent):
    """The table's cotangent of a lookup: each looked-up row's cotangent
    added to the row it came from."""
    g = np.asarray(cotangent, np.float64)
    d_table = np.zeros((count, g.shape[-1]))
    rows = np.arange(positions) if isinstance(positions, int) else np.asarray(positions).reshape(-1)
    np.add.at(d_table, rows, g.reshape(-1, g.shape[-1]))
    return d_table
