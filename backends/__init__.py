"""attnx's built-in backends.

Each module here is a plugin written exactly as a third party would write
one: a :class:`attnx.Backend` subclass and an ``attnx_backends`` hook
implementation, registered through the ``attnx.backends`` entry-point group
in ``pyproject.toml``.  None of them imports its array library at import
time.
"""
