"""The ``torch.autograd.Function`` of :meth:`TorchBackend.custom_vjp
<attnx_backends.torch_backend.TorchBackend.custom_vjp>`.

A module of its own, imported on first use (so that ``import attnx`` does
not import torch), with the class made at import: made inside the first
call instead, a first call under ``torch.compile`` had Dynamo trace the
class statement, which it refuses (``Invalid call to __build_class__``).
Written with ``setup_context``, so that ``torch.func``'s transforms
(``grad``, ``vmap``: ``generate_vmap_rule``) take it too.
"""

from __future__ import annotations

from typing import Any

import torch


class CustomVJP(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(forward: Any, backward: Any, *arrays: Any) -> Any:
        output, residuals = forward(*arrays)
        return (output, *residuals)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, outputs: Any) -> None:
        ctx.backward_rule, ctx.count = inputs[1], len(inputs) - 2
        ctx.mark_non_differentiable(*outputs[1:])
        ctx.save_for_backward(*inputs[2:], *outputs)

    @staticmethod
    def backward(ctx: Any, cotangent: Any, *unused: Any) -> Any:
        saved = ctx.saved_tensors
        arrays, output, residuals = saved[: ctx.count], saved[ctx.count], saved[ctx.count + 1 :]
        return (None, None, *ctx.backward_rule(arrays, output, residuals, cotangent))
