"""PyTorch's autograd through attnx's tiled attention: a
``torch.autograd.Function`` (``TorchBackend.custom_vjp``) whose backward is
attnx's own, so that the tape holds the inputs, the output and one pair of
statistics per row, never a tile; under ``torch.compile`` and
``torch.func``'s transforms as eagerly."""

from __future__ import annotations

import pytest

import attnx
from attnx import mods

torch = pytest.importorskip("torch")

B, H, N, D = 1, 2, 512, 16


def _inputs(dtype=torch.float32):
    generator = torch.Generator().manual_seed(58)
    return [torch.randn((B, H, N, D), generator=generator, dtype=dtype) for _ in range(3)]


def _causal():
    return attnx.create_block_mask(mods.causal, None, None, N, N, block_size=64, backend="torch")


def _saved_shapes(function, *arrays):
    """The shapes of the tensors autograd saves for the backward of ``function(*arrays)``."""
    shapes = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function(*arrays)
    return shapes


def test_the_tape_keeps_no_tile():
    """Every saved tensor is an input, the output or the rows' statistics:
    none has a key axis, which a tile of scores (rows x keys) would; with a
    ``score_mod`` of the user's own (its tiles stay on the tape, for what it
    closes over) the same count sees the tiles, so the test can tell."""
    leaves = [a.requires_grad_() for a in _inputs()]
    block_mask = _causal()
    saved = _saved_shapes(lambda q, k, v: attnx.flex_attention(q, k, v, None, block_mask), *leaves)
    assert saved, "nothing saved: the backward would have nothing to work from"
    assert all(shape[-1] in (D, 2) for shape in saved), saved
    assert sum(shape[-1] == D for shape in saved) == 4  # query, key, value, output
    own = _saved_shapes(lambda q, k, v: attnx.flex_attention(q, k, v, lambda s, *_: s / 2, block_mask), *leaves)
    assert any(shape[-1] not in (D, 2) for shape in own)


def _own_alibi(slopes):
    """ALiBi as PyTorch's documentation writes it: a score_mod of the user's own."""

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi


def test_attnx_mods_keep_no_tile_a_users_own_does():
    """attnx.mods' score_mods are differentiated by their own backward: the
    tape holds the inputs, the output, the rows' statistics and the mod's
    tables (ALiBi's slopes, a bias table), never a tile (rows x keys, both 64
    or more here; the mods' probe leaves 2 x 2 ones); a score_mod of the user's own keeps
    its tiles on the tape, so the count can tell."""
    leaves = [a.requires_grad_() for a in _inputs()]
    block_mask = _causal()
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    table = torch.linspace(-1, 1, 2 * 9).reshape(2, 9).requires_grad_()
    for mod in (mods.soft_cap(20.0), mods.alibi(slopes), mods.relative_bias(table)):
        saved = _saved_shapes(lambda q, k, v, mod=mod: attnx.flex_attention(q, k, v, mod, block_mask), *leaves)
        assert not [shape for shape in saved if len(shape) >= 2 and min(shape[-2:]) >= 64], saved
    own = _saved_shapes(lambda q, k, v: attnx.flex_attention(q, k, v, _own_alibi(slopes), block_mask), *leaves)
    assert [shape for shape in own if len(shape) >= 2 and min(shape[-2:]) >= 64], own


def test_a_mods_tables_get_the_gradients_of_the_tape():
    """ALiBi's slopes and the inputs, differentiated by attnx's tiled
    backward, equal autograd's tape through the same mod written as a
    user's own; in float64, and compiled, and under torch.func.grad and
    vmap."""
    leaves = [a.requires_grad_() for a in _inputs(torch.float64)]
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True)
    block_mask = _causal()

    def attention(make):
        return lambda q, k, v, s: attnx.flex_attention(q, k, v, make(s), block_mask)

    expected = _gradients(attention(_own_alibi), [*leaves, slopes])
    got = _gradients(attention(mods.alibi), [*leaves, slopes])
    compiled = _gradients(torch.compile(attention(mods.alibi), fullgraph=True, dynamic=False), [*leaves, slopes])

    def loss(s):
        return (attention(mods.alibi)(*leaves, s) ** 2).sum()

    transformed = torch.func.grad(loss)(slopes.detach())
    for name, result in (("eager", got), ("compiled", compiled), ("func.grad", (*expected[:3], transformed))):
        for grad, reference in zip(result, expected, strict=True):
            torch.testing.assert_close(
                grad, reference, rtol=1e-10, atol=1e-10, msg=lambda text, name=name: f"{name}: {text}"
            )
    # Batched slopes reach the Function as its inputs (a Function computing
    # on what it closes over fails under vmap).
    batch = torch.stack([slopes.detach(), slopes.detach().flip(0)])
    mapped = torch.func.vmap(torch.func.grad(loss))(batch)
    for row, batched in zip(batch, mapped, strict=True):
        (reference,) = _gradients(lambda s: attention(_own_alibi)(*leaves, s), [row.clone().requires_grad_()])
        torch.testing.assert_close(batched, reference, rtol=1e-10, atol=1e-10)


def _gradients(function, leaves):
    output = function(*leaves)
    return torch.autograd.grad((output * output).sum(), leaves)


def _dense_gradients(leaves):
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    return _gradients(
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal), leaves
    )


def test_gradients_equal_pytorchs_own_in_float64():
    leaves = [a.requires_grad_() for a in _inputs(torch.float64)]
    block_mask = _causal()
    got = _gradients(lambda q, k, v: attnx.flex_attention(q, k, v, None, block_mask), leaves)
    for grad, expected in zip(got, _dense_gradients(leaves)):
        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-10)


def test_compiled_and_transformed_gradients_equal_eager_ones():
    arrays = _inputs()
    block_mask = _causal()

    def attention(q, k, v):
        return attnx.flex_attention(q, k, v, None, block_mask)

    def loss(q, k, v):
        return (attention(q, k, v) ** 2).sum()

    leaves = [a.clone().requires_grad_() for a in arrays]
    eager = _gradients(attention, leaves)
    compiled = _gradients(torch.compile(attention, fullgraph=True, dynamic=False), leaves)
    grad = torch.func.grad(loss, argnums=(0, 1, 2))(*arrays)
    mapped = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(*(a.unsqueeze(1) for a in arrays))
    for name, result in (("compiled", compiled), ("func.grad", grad), ("vmap(grad)", [m.squeeze(1) for m in mapped])):
        for got, expected in zip(result, eager):
            torch.testing.assert_close(
                got, expected, rtol=1e-4, atol=1e-5, msg=lambda text, name=name: f"{name}: {text}"
            )


def test_no_tape_without_gradients():
    """Outside autograd (no input needs a gradient, or under no_grad) the
    forward runs alone: no Function on the output."""
    arrays = _inputs()
    block_mask = _causal()
    assert attnx.flex_attention(*arrays, None, block_mask).grad_fn is None
    leaves = [a.requires_grad_() for a in arrays]
    with torch.no_grad():
        assert attnx.flex_attention(*leaves, None, block_mask).grad_fn is None
    ((node, _),) = attnx.flex_attention(*leaves, None, block_mask).grad_fn.next_functions  # past the reshape
    assert type(node).__name__ == "CustomVJPBackward"
