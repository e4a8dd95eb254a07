"""attnx's attention as PyTorch layers: ``import attnx.torch`` (it imports PyTorch).

:class:`MultiheadAttention` is a drop-in for ``torch.nn.MultiheadAttention``:
the same constructor, ``forward`` and ``state_dict`` keys, computed by
:func:`attnx.multi_head_attention` on the module's own parameters, so that
attnx's memory-efficient tiles, its backward and its dropout (the same
mask on every library) serve a PyTorch model.  ``num_kv_heads`` adds
grouped-query heads, which PyTorch's layer lacks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from attnx.attention import scaled_dot_product_attention
from attnx.flex import flex_attention
from attnx.multihead import multi_head_attention, project
from attnx.positional import apply_rotary

__all__ = ["MultiheadAttention"]

#: Seeds of attnx's dropout masks, drawn from PyTorch's generator at each
#: training call (``torch.manual_seed`` makes a run repeatable).
_SEEDS = 2**31 - 1


class MultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention``, computed by attnx.

    Parameters
    ----------
    embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype
        As ``torch.nn.MultiheadAttention``'s, with its parameters, their
        names (``in_proj_weight``, or ``q_proj_weight``, ``k_proj_weight``,
        ``v_proj_weight`` where ``kdim`` or ``vdim`` differ; ``in_proj_bias``,
        ``out_proj``, ``bias_k``, ``bias_v``) and their initialisation, so
        that ``load_state_dict`` takes one module's state into the other.
        In training mode ``dropout`` drops attention weights by attnx's mask
        (:func:`attnx.scaled_dot_product_attention`'s ``dropout_seed``), its
        seed drawn from PyTorch's generator.
    num_kv_heads : int, optional
        Grouped-query heads: ``num_heads`` query heads over ``num_kv_heads``
        key/value heads (dividing it).  The key and value projections are
        then ``k_proj_weight (num_kv_heads * head_dim, kdim)`` and
        ``v_proj_weight``, and ``in_proj_weight`` is not used.
    rotary : bool
        Rotary positions (:func:`attnx.apply_rotary`, interleaved pairs, base
        ``rotary_base``) on each head's queries and keys, at positions ``0,
        1, ...`` of their sequences; not with ``add_bias_kv`` or
        ``add_zero_attn`` (their appended key has no position).
    rotary_base : float

    Raises
    ------
    ValueError
        If ``embed_dim`` is not a multiple of ``num_heads``, ``num_kv_heads``
        does not divide ``num_heads``, or ``dropout`` lies outside ``[0, 1]``.

    Examples
    --------
    >>> import torch
    >>> import attnx.torch
    >>> ours, theirs = attnx.torch.MultiheadAttention(8, 2), torch.nn.MultiheadAttention(8, 2)
    >>> _ = ours.load_state_dict(theirs.state_dict())
    >>> x = torch.randn(5, 3, 8)    # (L, N, E): batch_first=False, as PyTorch's default
    >>> mask = torch.ones(5, 5, dtype=torch.bool).triu(1)    # True: not attended, as PyTorch's
    >>> out, weights = ours(x, x, x, attn_mask=mask)
    >>> expected, expected_weights = theirs(x, x, x, attn_mask=mask)
    >>> torch.allclose(out, expected, atol=1e-6), weights.shape
    (True, torch.Size([3, 5, 5]))
    """

    __constants__ = ["batch_first"]

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: Any = None,
        dtype: Any = None,
        *,
        num_kv_heads: int | None = None,
        rotary: bool = False,
        rotary_base: float = 10000.0,
    ) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(
                f"MultiheadAttention: embed_dim must be a positive multiple of num_heads, got {embed_dim} and {num_heads}"
            )
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if kv_heads <= 0 or num_heads % kv_heads:
            raise ValueError(f"MultiheadAttention: num_kv_heads must divide num_heads = {num_heads}, got {kv_heads}")
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"MultiheadAttention: dropout must lie in [0, 1], got {dropout}")
        if rotary and (add_bias_kv or add_zero_attn):
            raise ValueError(
                "MultiheadAttention: rotary=True can't be combined with add_bias_kv or add_zero_attn "
                "(the key they append has no position)"
            )
        if rotary and (embed_dim // num_heads) % 2:
            raise ValueError(f"MultiheadAttention: rotary=True needs an even head_dim, got {embed_dim // num_heads}")
        self.rotary, self.rotary_base = bool(rotary), float(rotary_base)
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, kv_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.head_dim = embed_dim // num_heads
        self.dropout, self.batch_first, self.add_zero_attn = dropout, batch_first, add_zero_attn
        kv_width = kv_heads * self.head_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim and kv_heads == num_heads
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory))
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((kv_width, self.kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((kv_width, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(embed_dim + 2 * kv_width, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.modules.linear.NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, kv_width), **factory))
            self.bias_v = nn.Parameter(torch.empty((1, 1, kv_width), **factory))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # PyTorch's own initialisation, so that a model built with either layer starts alike.
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for weight in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def params(self) -> dict[str, torch.Tensor]:
        """The parameters as :func:`attnx.multi_head_attention` names them:
        views of the module's own, so gradients reach the module."""
        e, kv_width = self.embed_dim, self.num_kv_heads * self.head_dim
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.split(e, dim=0)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        params = {"w_q": w_q.T, "w_k": w_k.T, "w_v": w_v.T, "w_o": self.out_proj.weight.T}
        if self.in_proj_bias is not None:
            params.update(zip(("b_q", "b_k", "b_v"), self.in_proj_bias.split((e, kv_width, kv_width))))
        if self.out_proj.bias is not None:
            params["b_o"] = self.out_proj.bias
        if self.bias_k is not None:
            params["bias_k"], params["bias_v"] = self.bias_k.reshape(kv_width), self.bias_v.reshape(kv_width)
        return params

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        score_mod: Any = None,
        block_mask: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``torch.nn.MultiheadAttention.forward``: inputs ``(L, N, E)``
        (``(N, L, E)`` with ``batch_first``, or unbatched ``(L, E)``); masks
        whose ``True`` means *not attended* (or real masks added to the
        scores), ``key_padding_mask (N, S)``, ``attn_mask (L, S)`` or ``(N *
        num_heads, L, S)``; ``is_causal`` a hint that ``attn_mask`` is the
        causal mask, which it needs.  Returns the output and the weights
        (averaged over the heads unless ``average_attn_weights=False``), or
        None for them where ``need_weights=False``.

        ``score_mod`` and ``block_mask`` (keywords): the heads' attention is
        :func:`attnx.flex_attention`'s with them (PyTorch's FlexAttention
        convention, :mod:`attnx.mods`); masks then come as the block mask's
        ``mask_mod`` (``key_padding_mask`` and ``attn_mask`` are refused),
        and the layer takes no ``add_bias_kv`` or ``add_zero_attn``.

        Bad inputs are refused before any computation, by PyTorch's layer's
        rules: a TypeError where an input or a mask is not a tensor, or a
        mask is neither boolean nor floating; a ValueError naming the
        argument where a shape is not the layout above (``S`` the keys'
        positions, ``E`` the features ``embed_dim``, ``kdim`` and ``vdim``)."""
        self._check_inputs(query, key, value, key_padding_mask, attn_mask)
        if is_causal and attn_mask is None:
            raise ValueError("MultiheadAttention: is_causal=True is a hint that attn_mask is the causal mask: give it")
        flex = score_mod is not None or block_mask is not None
        if flex and (key_padding_mask is not None or attn_mask is not None):
            raise ValueError(
                "MultiheadAttention: with score_mod or block_mask, give the masks as the block mask's mask_mod "
                "(attnx.create_block_mask), not key_padding_mask or attn_mask"
            )
        if flex and (self.bias_k is not None or self.add_zero_attn):
            raise ValueError(
                "MultiheadAttention: score_mod and block_mask can't be combined with add_bias_kv or add_zero_attn"
            )
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        if not self.batch_first or unbatched:  # (L, N, E) -> (N, L, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        mask = self._attnx_mask(key_padding_mask, attn_mask, query.dtype, query.shape[0])
        options: dict[str, Any] = {}
        if self.training and self.dropout > 0:
            options["dropout_p"] = float(self.dropout)
            options["dropout_seed"] = torch.randint(_SEEDS, (), device=query.device)
        if self.rotary or flex:
            output, weights = self._heads_forward(query, key, value, mask, need_weights, score_mod, block_mask, options)
            if weights is not None and average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            result = multi_head_attention(
                query,
                key,
                value,
                self.params(),
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                mask=mask,
                return_weights=need_weights,
                average_weights=average_attn_weights,
                add_zero_attn=self.add_zero_attn,
                **options,
            )
            output, weights = result if need_weights else (result, None)
        if not self.batch_first or unbatched:
            output = output.transpose(0, 1)
        if unbatched:
            output = output.squeeze(1)
            weights = None if weights is None else weights.squeeze(0)
        return output, weights

    def _check_inputs(self, query: Any, key: Any, value: Any, key_padding_mask: Any, attn_mask: Any) -> None:
        """PyTorch's layer's rules for its inputs, as a TypeError or
        ValueError naming the argument, before any computation."""
        given = {
            "query": query,
            "key": key,
            "value": value,
            "key_padding_mask": key_padding_mask,
            "attn_mask": attn_mask,
        }
        for name, array in given.items():
            if array is not None and not isinstance(array, torch.Tensor):
                raise TypeError(f"MultiheadAttention: {name} must be a torch.Tensor, got {type(array).__name__}")
        layout = "(N, L, E)" if self.batch_first else "(L, N, E)"
        if query.dim() not in (2, 3):
            raise ValueError(
                f"MultiheadAttention: query must be unbatched (L, E) or batched {layout}, "
                f"got shape {tuple(query.shape)}"
            )
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                f"MultiheadAttention: key and value must be {query.dim()}-D as query is, "
                f"got shapes {tuple(key.shape)} and {tuple(value.shape)}"
            )
        for name, array, features in (
            ("query", query, self.embed_dim),
            ("key", key, self.kdim),
            ("value", value, self.vdim),
        ):
            if array.shape[-1] != features:
                raise ValueError(
                    f"MultiheadAttention: {name} must have {features} features (its last axis), "
                    f"got shape {tuple(array.shape)}"
                )
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                "MultiheadAttention: key and value must have the same positions and batch, "
                f"got shapes {tuple(key.shape)} and {tuple(value.shape)}"
            )
        batched = query.dim() == 3
        batch_axis, position_axis = (0, 1) if self.batch_first else (1, 0)
        if not batched:
            position_axis = 0
        elif query.shape[batch_axis] != key.shape[batch_axis]:
            raise ValueError(
                f"MultiheadAttention: query and key must have the same batch size N, "
                f"got shapes {tuple(query.shape)} and {tuple(key.shape)}"
            )
        n, m = query.shape[position_axis], key.shape[position_axis]
        batch = query.shape[batch_axis] if batched else 1
        masks = {
            "key_padding_mask": (
                key_padding_mask,
                [(batch, m)] if batched else [(m,)],
                "(N, S)" if batched else "(S,)",
            ),
            "attn_mask": (
                attn_mask,
                [(n, m), (batch * self.num_heads, n, m)],
                "(L, S) or (N * num_heads, L, S)" if batched else "(L, S) or (num_heads, L, S)",
            ),
        }
        for name, (mask, shapes, words) in masks.items():
            if mask is None:
                continue
            if mask.dtype != torch.bool and not mask.is_floating_point():
                raise TypeError(f"MultiheadAttention: {name} must be boolean or floating, got {mask.dtype}")
            if tuple(mask.shape) not in shapes:
                raise ValueError(
                    f"MultiheadAttention: {name} must have shape {words} = "
                    f"{' or '.join(map(str, shapes))}, got {tuple(mask.shape)}"
                )

    def _heads_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: Any,
        need_weights: bool,
        score_mod: Any,
        block_mask: Any,
        options: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The extras' path, batch first: the projections, the heads
        ``(N, H, L, head_dim)`` (rotated where ``rotary``), attnx's SDPA or
        flex attention on them, and the output projection."""
        params = self.params()
        heads = []
        for x, name, count in (
            (query, "q", self.num_heads),
            (key, "k", self.num_kv_heads),
            (value, "v", self.num_kv_heads),
        ):
            projected = project(x, params, f"w_{name}", f"b_{name}")
            heads.append(projected.unflatten(-1, (count, self.head_dim)).transpose(1, 2))
        q, k, v = heads
        if self.rotary:
            q, k = (apply_rotary(x, base=self.rotary_base) for x in (q, k))
        grouped = self.num_kv_heads != self.num_heads
        if score_mod is not None or block_mask is not None:
            result = flex_attention(
                q, k, v, score_mod, block_mask, enable_gqa=grouped, return_weights=need_weights, **options
            )
        else:
            if mask is not None and mask.dim() == 3:  # (N, 1, S): a padding mask, without the heads' axis
                mask = mask[:, None]
            result = scaled_dot_product_attention(
                q, k, v, mask=mask, enable_gqa=grouped, return_weights=need_weights, **options
            )
        output, weights = result if need_weights else (result, None)
        return project(output.transpose(1, 2).flatten(-2), params, "w_o", "b_o"), weights

    def _attnx_mask(self, key_padding_mask: Any, attn_mask: Any, dtype: Any, batch: int) -> Any:
        """PyTorch's two masks (``True``: not attended) as attnx's one mask
        (``True``: attended; or real, added): ``(L, S)``, ``(N, 1, S)`` or per
        head ``(N, H, L, S)``."""
        masks = []
        if attn_mask is not None:
            if attn_mask.dim() == 3:  # (N * H, L, S): one per head
                attn_mask = attn_mask.reshape(batch, self.num_heads, *attn_mask.shape[-2:])
            masks.append(attn_mask)
        if key_padding_mask is not None:
            per_head = attn_mask is not None and attn_mask.dim() == 4
            masks.append(key_padding_mask[:, None, None, :] if per_head else key_padding_mask[:, None, :])
        if not masks:
            return None
        if all(m.dtype == torch.bool for m in masks):
            allowed = ~masks[0]
            return allowed if len(masks) == 1 else allowed & ~masks[1]
        # A real mask among them: PyTorch adds the two, its boolean one as -inf where True.
        added = [
            torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, -math.inf)
            if m.dtype == torch.bool
            else m.to(dtype)
            for m in masks
        ]
        return added[0] if len(added) == 1 else added[0] + added[1]
