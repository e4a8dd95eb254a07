"""`attnx conformance NAME --coverage`: what attnx asks of a namespace,
against what the backend's namespace has, before any test runs."""

from __future__ import annotations

import types

import pytest

import attnx
from attnx import cli
from attnx_conformance import coverage

strict = pytest.importorskip("array_api_strict")


def test_the_functions_are_read_from_attnx_s_own_algorithms():
    names = coverage.namespace_functions()
    assert {"exp", "matrix_transpose", "cumulative_sum", "searchsorted", "concat"} <= set(names)
    assert "format_table" not in names and "ArgumentParser" not in names


def test_every_built_in_backend_has_all_it_is_asked(capsys):
    assert cli.main(["conformance", "numpy", "--coverage"]) == 0
    out = capsys.readouterr().out
    assert "xp.cumulative_sum" in out and "a @ b" in out and "concat along a negative axis" in out
    assert "missing" not in out and "refused" not in out


def test_a_namespace_is_shown_what_it_lacks(array_api_strict_backend, register_backend, capsys):
    """array-api-strict as a library might give it: no cumulative_sum
    (2023.12's), and a clip that wants both bounds."""
    names = {name: getattr(strict, name) for name in dir(strict) if not name.startswith("_")}
    del names["cumulative_sum"]

    def clip(x, min, max):
        return strict.clip(x, min=min, max=max)

    names["clip"] = clip
    older = types.SimpleNamespace(**names, __array_namespace_info__=strict.__array_namespace_info__)

    class Older(type(array_api_strict_backend)):
        name = "older_strict"

        def namespace(self):
            return older

    register_backend(Older(), "older-strict-plugin")
    assert cli.main(["conformance", "older_strict", "--coverage"]) == 1
    out = capsys.readouterr().out
    table = {line.split("  ")[0]: line for line in out.splitlines()}
    assert table["xp.cumulative_sum"].endswith("missing")
    assert "refused: TypeError" in table["clip with one bound (2023.12)"]
    assert table["xp.exp"].endswith("ok") and table["a @ b"].endswith("ok")
    assert "3 missing or refused" in out  # cumulative_sum, its use along an axis, clip


def test_a_device_that_prints_as_an_object_is_named(register_backend, loopback_class):
    class Opaque:  # prints as <...Opaque object at 0x...>
        pass

    class Backend(loopback_class):
        name = "opaque-devices"

        def devices(self):
            return [Opaque()]

    backend = register_backend(Backend(), "opaque-plugin")
    row = next(row for row in coverage.rows(backend) if row[0] == "devices() print as names")
    assert "prints as an object" in row[2]
    assert attnx  # the registry holds it for the test's span
