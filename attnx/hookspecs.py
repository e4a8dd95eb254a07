"""Hook specifications for attnx plugins.

A plugin is a module (or any object) with functions marked by
:data:`hookimpl`.  attnx finds plugins through the entry-point group
``attnx.backends``; a package registers one in its ``pyproject.toml``::

    [project.entry-points."attnx.backends"]
    mylib = "attnx_mylib.backend"

The module named there must import cheaply: attnx imports every plugin module
the first time a backend is needed, so heavy imports (the array library
itself) belong inside the :class:`attnx.Backend` methods, not at the top of
the module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from collections.abc import Sequence

    from attnx.backend import Backend

PROJECT_NAME = "attnx"

#: Marker for hook specifications (attnx's own use).
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marker for hook implementations: decorate your plugin's functions with it.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def attnx_backends() -> Sequence[Backend]:
    """Return the backends this plugin provides.

    Called once per plugin, when attnx first needs its backends.  Return a
    sequence of :class:`attnx.Backend` instances, each with a unique
    :attr:`~attnx.Backend.name`.  Creating an instance must not import the
    array library: availability is asked later, through
    :meth:`~attnx.Backend.unavailable_reason`.

    Example
    -------
    ::

        from attnx import Backend, hookimpl

        class MyBackend(Backend):
            name = "mylib"
            array_module = "mylib"
            ...

        @hookimpl
        def attnx_backends():
            return [MyBackend()]
    """
