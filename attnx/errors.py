"""Exceptions and warnings raised by attnx."""

__all__ = ["BackendUnavailableError", "PluginError", "PluginWarning"]


class BackendUnavailableError(RuntimeError):
    """A registered backend cannot run here (library missing, no device...)."""


class PluginError(RuntimeError):
    """A plugin failed to load, with ``ATTNX_STRICT_PLUGINS=1`` set."""


class PluginWarning(UserWarning):
    """A plugin failed to load or conflicts with another; attnx goes on without it."""
