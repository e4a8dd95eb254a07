"""PyTorch's own functions as a second, independent oracle (needs torch)."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx_conformance.helpers import rng

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

    def compare(ours, theirs):
        np.testing.assert_allclose(be.numpy(ours), theirs.numpy(), rtol=1e-10, atol=1e-12)

    compare(attnx.scaled_dot_product_attention(*args), F.scaled_dot_product_attention(t(q), t(k), t(v)))
    compare(
        attnx.scaled_dot_product_attention(*args, mask=be.array(mask), scale=0.2),
        F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=torch.from_numpy(mask), scale=0.2),
    )
    # attnx aligns is_causal bottom-right; PyTorch top-left: equal when n == m.
    top_left = np.tril(np.ones((n, m), dtype=bool))
    theirs = F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=torch.from_numpy(top_left))
    compare(attnx.scaled_dot_product_attention(*args, mask=be.array(top_left)), theirs)
    if n == m:
        compare(
            attnx.scaled_dot_product_attention(*args, is_causal=True),
            F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True),
        )
    padding = torch.arange(m)[None, None, None, :] < torch.from_numpy(lengths)[:, None, None, None]
    compare(
        attnx.scaled_dot_product_attention(*args, key_lengths=be.array(lengths)),
        F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=padding),
    )
