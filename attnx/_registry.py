"""The backend registry: plugins found through entry points, loaded lazily."""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Collection
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import pluggy

from attnx import hookspecs
from attnx._tracing import run_at_trace_time
from attnx.backend import Backend, device_label
from attnx.errors import BackendUnavailableError, PluginError, PluginWarning

ENTRY_POINT_GROUP = "attnx.backends"
#: Set to 1 to turn plugin failures into exceptions (for backend authors and CI).
STRICT_ENV = "ATTNX_STRICT_PLUGINS"


@dataclass(frozen=True)
class BackendInfo:
    """One row of :func:`attnx.list_backends`."""

    name: str
    available: bool
    reason: str | None
    version: str | None
    devices: tuple[str, ...]
    distribution: str | None


@dataclass
class _Entry:
    backend: Backend | None
    plugin: str
    distribution: str | None
    error: str | None = None
    _reason: Any = field(default=..., repr=False)

    def reason(self) -> str | None:
        if self._reason is ...:
            if self.error is not None:
                self._reason = self.error
            else:
                try:
                    self._reason = self.backend.unavailable_reason()
                except Exception as exc:  # a broken check must not break attnx
                    self._reason = f"availability check failed: {exc!r}"
            if self._reason is None:
                # Available by its own word: its namespace must import too, or
                # the first call would end in a bare traceback.
                try:
                    _ = self.backend.xp
                except Exception as exc:
                    self._reason = f"its array namespace failed to import: {exc!r}"
        return self._reason


class Registry:
    """Backends by name, built from pluggy plugins on first use."""

    def __init__(self, group: str = ENTRY_POINT_GROUP) -> None:
        self.group = group
        self.plugin_manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.plugin_manager.add_hookspecs(hookspecs)
        self._entries: dict[str, _Entry] = {}
        self._failures: list[_Entry] = []
        #: Backends that lost a name conflict: (name, the ignored entry).
        self._ignored: list[tuple[str, _Entry]] = []
        self._type_owners: dict[type, Backend] = {}
        self._shared_types: set[type] = set()
        #: Array types whose owner has several devices: only their inputs are
        #: compared device by device (the comparison costs a microsecond a call).
        self._multi_device_types: set[type] = set()
        #: Plans by call signature (:mod:`attnx._plans`): they depend on who
        #: owns which type, so they go whenever a backend comes or goes.
        self._plans: dict[tuple[Any, ...], tuple[Any, str, str]] = {}
        #: Array types whose one owner makes plans (:meth:`Backend.specialize`).
        self._planning_types: set[type] = set()
        self._loaded = False
        self._lock = threading.RLock()

    # -- loading ------------------------------------------------------------
    @run_at_trace_time
    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            found = sorted(
                entry_points(group=self.group),
                # attnx's own backends first, so they win ownership ties.
                key=lambda ep: (_dist_name(ep) != "attnx", _dist_name(ep) or "", ep.name),
            )
            for ep in found:
                try:
                    plugin = ep.load()
                except Exception as exc:
                    self._fail(ep.name, _dist_name(ep), f"failed to import {ep.value!r}: {exc!r}")
                    continue
                self._add_plugin(plugin, ep.name, _dist_name(ep))
            self._loaded = True

    def _fail(self, plugin: str, distribution: str | None, message: str, listed: bool = True) -> None:
        if listed:
            self._failures.append(_Entry(None, plugin, distribution, error=message))
        text = f"attnx plugin {plugin!r} ({distribution or 'no distribution'}): {message}"
        if os.environ.get(STRICT_ENV, "") not in ("", "0"):
            raise PluginError(text)
        warnings.warn(text, PluginWarning, stacklevel=4)

    def _add_plugin(self, plugin: Any, name: str, distribution: str | None) -> None:
        pm = self.plugin_manager
        try:
            pm.register(plugin, name=name)
        except Exception as exc:
            self._fail(name, distribution, f"failed to register: {exc!r}")
            return
        for impl in pm.hook.attnx_backends.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            try:
                backends = list(impl.function())
                for backend in backends:
                    if not isinstance(backend, Backend) or not backend.name:
                        raise TypeError(f"expected named attnx.Backend instances, got {backend!r}")
            except Exception as exc:
                self._fail(name, distribution, f"attnx_backends() failed: {exc!r}")
                continue
            for backend in backends:
                self._add_backend(_Entry(backend, name, distribution))
        self._forget_types()

    def _forget_types(self) -> None:
        """Drop what was learnt of array types (their owners, and the plans
        made for them): a backend came or went."""
        self._type_owners.clear()
        self._shared_types.clear()
        self._multi_device_types.clear()
        self._planning_types.clear()
        self._plans.clear()

    def _add_backend(self, entry: _Entry) -> None:
        name = entry.backend.name
        previous = self._entries.get(name)
        if previous is None:
            self._entries[name] = entry
            return
        # Two plugins claim one name: the first claim wins, and both are told.
        if previous.distribution == "attnx":
            why = "attnx's own backends are loaded first"
        elif previous.distribution is not None and entry.distribution is not None:
            why = "plugins are loaded in order of their distribution's name and the first claim wins"
        else:
            why = "it was registered first"
        message = (
            f"backend name {name!r} is claimed twice: plugin {previous.plugin!r} from "
            f"{previous.distribution or 'no distribution'} is used and plugin {entry.plugin!r} from "
            f"{entry.distribution or 'no distribution'} is ignored, because {why}; uninstall one of "
            f"them or rename a backend to use both"
        )
        ignored = _Entry(entry.backend, entry.plugin, entry.distribution, error=f"ignored: {message}")
        self._ignored.append((name, ignored))
        self._fail(entry.plugin, entry.distribution, message, listed=False)

    # -- public operations ------------------------------------------------------
    def register_plugin(self, plugin: Any, name: str | None = None) -> str:
        """Register a plugin object (module) at runtime; returns its name."""
        self._ensure_loaded()
        with self._lock:
            name = name or getattr(plugin, "__name__", None) or repr(plugin)
            self._add_plugin(plugin, name, None)
            return name

    def unregister_plugin(self, name: str) -> None:
        """Remove a plugin registered under ``name`` and its backends."""
        self._ensure_loaded()
        with self._lock:
            self.plugin_manager.unregister(name=name)
            self._entries = {k: e for k, e in self._entries.items() if e.plugin != name}
            self._failures = [e for e in self._failures if e.plugin != name]
            self._ignored = [(n, e) for n, e in self._ignored if e.plugin != name]
            self._forget_types()

    def names(self) -> list[str]:
        self._ensure_loaded()
        return list(self._entries)

    def get(self, name: str) -> Backend:
        """The backend called ``name``, ready to use; raises if it can't be."""
        if not isinstance(name, str):
            raise TypeError(f"an attnx backend is named by a str, as `attnx backends` lists, got {name!r}")
        self._ensure_loaded()
        entry = self._entries.get(name)
        if entry is None:
            known = ", ".join(repr(n) for n in self._entries) or "none"
            raise ValueError(f"unknown attnx backend {name!r}; registered backends: {known}")
        reason = entry.reason()
        if reason is not None:
            raise BackendUnavailableError(f"attnx backend {name!r} is unavailable: {reason}")
        return entry.backend

    def owners_of(self, array: Any) -> list[Backend]:
        """The available backends that own ``array``'s type, first the one
        that wins; nothing is cached (see :meth:`owner_of`)."""
        self._ensure_loaded()
        return [
            entry.backend
            for entry in self._entries.values()
            if entry.backend is not None and entry.backend.owns(array) and entry.reason() is None
        ]

    def owner_of(self, array: Any) -> Backend | None:
        """The first available backend that owns ``array``'s type (cached)."""
        kind = type(array)
        owner = self._type_owners.get(kind)
        if owner is None:
            owners = self.owners_of(array)
            if owners:
                owner = self._type_owners[kind] = owners[0]
                if len(owners) > 1:
                    self._shared_types.add(kind)
                elif type(owner).specialize is not Backend.specialize:
                    self._planning_types.add(kind)
                if _device_count(owner) > 1:
                    self._multi_device_types.add(kind)
        return owner

    def is_concrete(self, array: Any) -> bool:
        """Whether ``array``'s values can be read now (its owner's
        :meth:`~attnx.Backend.is_concrete`): not while it is traced or lazy."""
        owner = self.owner_of(array)
        return owner is None or owner.is_concrete(array)

    def is_shared(self, kind: type) -> bool:
        """Whether more than one available backend owns arrays of type ``kind``."""
        return kind in self._shared_types

    def info(self, names: Collection[str] | None = None) -> list[BackendInfo]:
        """Each backend's record; of registered backends, only ``names``'
        where given (asking a backend whether it is available imports its
        library: seconds for PyTorch)."""
        self._ensure_loaded()
        rows = []
        for name, entry in self._entries.items():
            if names is not None and name not in names:
                continue
            reason = entry.reason()
            version = devices = None
            if reason is None:
                try:
                    version = entry.backend.version()
                    devices = tuple(device_label(d) for d in entry.backend.devices())
                except Exception as exc:
                    reason = f"failed to query: {exc!r}"
            rows.append(BackendInfo(name, reason is None, reason, version, devices or (), entry.distribution))
        for entry in self._failures:
            if entry.plugin not in self._entries:
                rows.append(BackendInfo(entry.plugin, False, entry.error, None, (), entry.distribution))
        for name, entry in self._ignored:
            rows.append(BackendInfo(name, False, entry.error, None, (), entry.distribution))
        return rows


def _device_count(backend: Backend) -> int:
    try:
        return len(backend.devices())
    except Exception:  # can't tell: compare devices, to be safe
        return 2


def _dist_name(ep: Any) -> str | None:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else None


registry = Registry()
