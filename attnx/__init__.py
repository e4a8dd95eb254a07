"""attnx: the attention family, written once against the array API standard.

Run it on NumPy, PyTorch, CuPy or any array library that a backend plugin
registers through the ``attnx.backends`` entry-point group.
"""

from attnx import blocks, masks, mods, natives
from attnx._config import get_backend, get_memory_budget, memory_budget, set_backend, set_memory_budget, use_backend
from attnx._registry import BackendInfo
from attnx._registry import registry as _registry
from attnx._typing import Array, Device, DType
from attnx.additive import additive_attention, bahdanau_context
from attnx.attention import masked_softmax, scaled_dot_product_attention
from attnx.backend import Backend
from attnx.conversion import asarray, list_backends, to_numpy
from attnx.convolution import causal_conv1d, receptive_field
from attnx.errors import BackendUnavailableError, PluginError, PluginWarning
from attnx.flex import BlockMask, and_masks, create_block_mask, flex_attention, or_masks
from attnx.gradients import vjp
from attnx.hookspecs import hookimpl
from attnx.kernel_regression import nadaraya_watson
from attnx.multihead import MultiHeadAttention, init_multi_head_params, multi_head_attention
from attnx.positional import LearnedPositions, apply_rotary, sinusoidal_positions

__version__ = "0.1.0"

#: The pluggy ``PluginManager`` holding attnx's plugins.
plugin_manager = _registry.plugin_manager
register_plugin = _registry.register_plugin
unregister_plugin = _registry.unregister_plugin


def __getattr__(name: str):
    # attnx.plot and the framework layers (attnx.torch, attnx.flax,
    # attnx.keras) without importing them first, nor their libraries with attnx.
    if name in ("plot", "torch", "flax", "keras"):
        import importlib

        return importlib.import_module(f"attnx.{name}")
    raise AttributeError(f"module 'attnx' has no attribute {name!r}")


__all__ = [
    "Array",
    "DType",
    "Device",
    "LearnedPositions",
    "MultiHeadAttention",
    "additive_attention",
    "apply_rotary",
    "blocks",
    "BlockMask",
    "and_masks",
    "create_block_mask",
    "flex_attention",
    "mods",
    "natives",
    "or_masks",
    "bahdanau_context",
    "causal_conv1d",
    "init_multi_head_params",
    "multi_head_attention",
    "nadaraya_watson",
    "plot",
    "receptive_field",
    "sinusoidal_positions",
    "Backend",
    "BackendInfo",
    "BackendUnavailableError",
    "PluginError",
    "PluginWarning",
    "asarray",
    "get_backend",
    "get_memory_budget",
    "memory_budget",
    "set_memory_budget",
    "hookimpl",
    "list_backends",
    "masked_softmax",
    "masks",
    "plugin_manager",
    "register_plugin",
    "scaled_dot_product_attention",
    "set_backend",
    "to_numpy",
    "unregister_plugin",
    "use_backend",
    "vjp",
]
