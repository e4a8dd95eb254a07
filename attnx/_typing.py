"""The names attnx's public signatures give the things they take.

Each is ``Any`` to a type checker, since attnx takes the arrays, dtypes
and devices of libraries it does not import; the names say to a reader
what ``Any`` did not.
"""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = ["Array", "DType", "Device"]

#: An array of any registered backend: a NumPy array, a PyTorch tensor, a
#: JAX or CuPy array, a Dask array, or a plugin's.
Array: TypeAlias = Any
#: A dtype of any library (``numpy.float32``, ``torch.float32``) or its name (``"float32"``).
DType: TypeAlias = Any
#: A device by the name ``attnx backends`` lists (``"cuda:0"``, ``"cpu"``), or the library's own object.
Device: TypeAlias = Any
