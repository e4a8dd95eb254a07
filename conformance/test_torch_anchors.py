"""PyTorch's own functions as a second, independent oracle (needs torch)."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx.attention import sdpa_generic
from attnx_conformance.helpers import rng, tolerances

torch = pytest.importorskip("torch", reason="the anchor tests compare with PyTorch's own functions")
F = torch.nn.functional

pytestmark = pytest.mark.attnx_operation("scaled_dot_product_attention")


def t(a):
    return torch.from_numpy(np.asarray(a, dtype=np.float64))


@pytest.mark.parametrize("n, m", [(5, 5), (3, 7), (1, 4)])
def test_sdpa_matches_torch(attnx_backend, n, m):
    be = attnx_backend
    gen = rng(11, n, m)
    q, k, v = (gen.standard_normal(s) for s in ((2, 3, n, 8), (2, 3, m, 8), (2, 3, m, 5)))
    mask = gen.random((2, 1, n, m)) < 0.8
    lengths = np.array([m, max(1, m - 2)])
    args = [be.array(a, "float64") for a in (q, k, v)]

    def compare(theirs, **kwargs):
        """attnx's call, and attnx's generic algorithm called directly (on
        torch the call itself runs PyTorch's SDPA: that alone would compare
        PyTorch with itself), against PyTorch."""
        ours = attnx.scaled_dot_product_attention(*args, **kwargs)
        generic = sdpa_generic(
            be.xp,
            **dict(zip(("query", "key", "value"), args)),
            mask=kwargs.get("mask"),
            key_lengths=kwargs.get("key_lengths"),
            is_causal=kwargs.get("is_causal", False),
            scale=kwargs.get("scale", 8**-0.5),  # a Python float, as natives and the generic receive it
            return_weights=False,
        )
        for got in (ours, generic):
            np.testing.assert_allclose(be.numpy(got), theirs.numpy(), **tolerances(be))

    compare(F.scaled_dot_product_attention(t(q), t(k), t(v)))
    compare(
        F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=torch.from_numpy(mask), scale=0.2),
        mask=be.array(mask),
        scale=0.2,
    )
    # attnx aligns is_causal bottom-right; PyTorch top-left: equal when n == m.
    top_left = np.tril(np.ones((n, m), dtype=bool))
    compare(
        F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=torch.from_numpy(top_left)),
        mask=be.array(top_left),
    )
    if n == m:
        compare(F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True), is_causal=True)
    padding = torch.arange(m)[None, None, None, :] < torch.from_numpy(lengths)[:, None, None, None]
    compare(F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=padding), key_lengths=be.array(lengths))
