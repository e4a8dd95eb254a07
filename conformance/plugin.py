"""The pytest plugin behind ``pytest --pyargs attnx_conformance``.

Installed with attnx (entry point ``pytest11``), so it is active in every
pytest run where attnx is installed; it does nothing unless a test asks for
the ``attnx_backend`` fixture.

Selecting backends, in order: ``--attnx-backend NAME`` (repeatable), else
``$ATTNX_TEST_BACKEND`` (comma-separated), else every registered backend.

A run never reports green having tested nothing.  A selected backend that is
not registered, that is unavailable here (unless ``--attnx-allow-unavailable``
says that is expected: its tests are then skipped with the reason), or a
``--attnx-device`` it does not list, is a usage error before any test runs;
and a selected backend for which no test ran fails the session.  Without a
selection (every registered backend), unavailable backends are skipped with
their reason.

A backend's known failures can be listed in a file (``--attnx-xfails PATH``,
or ``$ATTNX_TEST_XFAILS``): they run as xfail, and entries that match no
test are warned about.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

ENV = "ATTNX_TEST_BACKEND"
ALLOW_UNAVAILABLE_ENV = "ATTNX_TEST_ALLOW_UNAVAILABLE"
XFAILS_ENV = "ATTNX_TEST_XFAILS"
DEVICE_ENV = "ATTNX_TEST_DEVICE"
CHUNKING_ENV = "ATTNX_TEST_CHUNKING"
#: The chunking that leaves arrays as the backend's ``asarray`` makes them.
AS_MADE = "as made"

_HYPOTHESIS_HOME = pytest.StashKey[str]()
#: node id -> backend under test; tests that ran (not skipped), per backend.
_RAN_COUNTS: dict[str, int] = defaultdict(int)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnx", "attnx conformance suite")
    group.addoption(
        "--attnx-backend",
        action="append",
        default=[],
        metavar="NAME",
        help=f"run the attnx conformance suite on this backend (repeatable; default ${ENV} or all)",
    )
    group.addoption(
        "--attnx-device",
        default=os.environ.get(DEVICE_ENV) or None,
        metavar="DEVICE",
        help=f"make the inputs on this device, named as `attnx backends` lists it (default ${DEVICE_ENV} or the backend's default)",
    )
    group.addoption(
        "--attnx-chunking",
        default=os.environ.get(CHUNKING_ENV) or None,
        metavar="NAME",
        help=(
            "cut every input this way, one of the backend's test_chunkings() or 'as made' "
            f"(default ${CHUNKING_ENV}, else the tests take turns over them)"
        ),
    )
    group.addoption(
        "--attnx-allow-unavailable",
        action="store_true",
        default=os.environ.get(ALLOW_UNAVAILABLE_ENV, "") not in ("", "0"),
        help=f"skip, with the reason, a selected backend that can't run here instead of failing (default ${ALLOW_UNAVAILABLE_ENV})",
    )
    group.addoption(
        "--attnx-xfails",
        default=os.environ.get(XFAILS_ENV),
        metavar="PATH",
        help=f"file of known failures, one test-id fragment per line, '# reason' after it (default ${XFAILS_ENV})",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "attnx_operation(name): the attnx operation a test checks")
    names = explicit_selection(config)
    if names:
        # Hypothesis caches what it learns (constants found in the code) in
        # ./.hypothesis: a conformance run leaves nothing in the user's folder.
        import tempfile

        from hypothesis.configuration import set_hypothesis_home_dir

        config.stash[_HYPOTHESIS_HOME] = home = tempfile.mkdtemp(prefix="attnx-conformance-")
        set_hypothesis_home_dir(home)
        problem = selection_problem(
            names,
            config.getoption("--attnx-device", default=None),
            config.getoption("--attnx-allow-unavailable", default=False),
            chunking=config.getoption("--attnx-chunking", default=None),
        )
        if problem is not None:
            raise pytest.UsageError(problem)


def pytest_unconfigure(config: pytest.Config) -> None:
    home = config.stash.get(_HYPOTHESIS_HOME, None)
    if home is not None:
        import shutil

        shutil.rmtree(home, ignore_errors=True)


def explicit_selection(config: pytest.Config) -> list[str]:
    """The backends the user named (option or environment), or ``[]``."""
    names = list(config.getoption("--attnx-backend", default=[]) or [])
    if not names and os.environ.get(ENV):
        names = [n.strip() for n in os.environ[ENV].split(",") if n.strip()]
    return names


def selected_backends(config: pytest.Config) -> list[str]:
    names = explicit_selection(config)
    if not names:
        import attnx

        names = [info.name for info in attnx.list_backends() if info.name in attnx._registry.names()]
    return names


def selection_problem(
    names: list[str],
    device: str | None,
    allow_unavailable: bool,
    *,
    flag: str = "--attnx-allow-unavailable",
    chunking: str | None = None,
) -> str | None:
    """Why the suite can't test ``names`` (on ``device``), as one line, or
    None.  The one check behind ``attnx conformance`` and ``pytest
    --attnx-backend``."""
    import attnx
    from attnx.backend import device_label

    infos = {info.name: info for info in attnx._registry.info(names)}
    registered = attnx._registry.names()
    for name in names:
        if name not in registered:
            failed = [
                f"{info.name!r} ({info.distribution}): {info.reason}"
                for info in infos.values()
                if info.name not in registered
            ]
            text = f"unknown attnx backend {name!r}; registered backends: {', '.join(registered) or 'none'}"
            if failed:
                text += "; plugins that failed to load: " + "; ".join(failed)
            return text
        info = infos[name]
        if not info.available and not allow_unavailable:
            return f"attnx backend {name!r} is unavailable here: {info.reason} ({flag} skips its tests instead)"
        if device is not None and info.available:
            listed = [device_label(d) for d in attnx._registry.get(name).devices()]
            if device not in listed:
                return f"attnx backend {name!r} has no device {device!r}; its devices: {', '.join(listed)}"
        if chunking is not None and info.available:
            declared = [AS_MADE, *attnx._registry.get(name).test_chunkings()]
            if chunking not in declared:
                return (
                    f"attnx backend {name!r} has no chunking {chunking!r}; it declares {', '.join(map(repr, declared))}"
                )
    return None


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not config.getoption("--attnx-backend", default=[]) and not os.environ.get(ENV):
        return []
    import attnx

    names = selected_backends(config)
    infos = {info.name: info for info in attnx._registry.info(names)}
    lines = [f"attnx {attnx.__version__}; backends under test:"]
    for name in names:
        info = infos.get(name)
        if info is None:
            lines.append(f"  {name}: not registered")
        elif info.available:
            lines.append(f"  {name} {info.version} ({info.distribution}), devices {', '.join(info.devices)}")
        else:
            lines.append(f"  {name}: unavailable: {info.reason}")
    return lines


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "attnx_backend" in metafunc.fixturenames:
        names = selected_backends(metafunc.config)
        metafunc.parametrize("attnx_backend", names, indirect=True, ids=names)


@dataclass
class BackendUnderTest:
    """The backend a conformance test runs on, with helpers to make inputs."""

    name: str
    backend: Any
    device: Any = None
    dtypes: tuple[str, ...] = field(default=())
    #: How :meth:`array` cuts the inputs (the backend's ``test_chunkings()``), and its name.
    chunking: Any = None
    chunking_name: str = AS_MADE

    @property
    def xp(self) -> Any:
        return self.backend.xp

    @property
    def widest(self) -> str:
        """The widest float dtype the backend offers: the checks written for
        float64 run in it (with its tolerances) where float64 is missing, as on
        JAX without x64 mode and many GPU libraries."""
        for dtype in ("float64", "float32", "bfloat16", "float16"):
            if dtype in self.dtypes:
                return dtype
        raise ValueError(f"backend {self.name!r} lists no float dtype attnx knows: {self.dtypes}")

    def dtype(self, dtype: str) -> str:
        """``dtype``, or :attr:`widest` in place of a float64 the backend lacks."""
        return self.widest if dtype == "float64" and dtype not in self.dtypes else dtype

    def array(self, data: Any, dtype: str | None = None) -> Any:
        """A NumPy array (or nested list) as this backend's array, on the
        device under test (through :func:`attnx.asarray`, as a user would).
        float64 data (given or implied) comes in :meth:`dtype`'s stead."""
        import numpy as np

        import attnx

        data = np.asarray(data)
        if dtype is None and data.dtype == np.float64:
            dtype = "float64"
        if dtype is not None:
            dtype = self.dtype(dtype)
        if dtype == "bfloat16":
            array = attnx.asarray(data.astype(np.float32), backend=self.name, dtype="bfloat16", device=self.device)
        else:
            if dtype is not None:
                data = data.astype(dtype)
            array = attnx.asarray(data, backend=self.name, device=self.device)
        return array if self.chunking is None else self.chunking(array)

    def numpy(self, array: Any) -> Any:
        return self.backend.to_numpy(array)

    @property
    def lazy(self) -> bool:
        """Whether the arrays it makes are lazy (their values can't be read
        before computing): the checks of values are then skipped by design."""
        return not self.backend.is_concrete(self.array([0.0], "float32"))

    def dtype_name(self, array: Any) -> str:
        """``"float32"`` for every library's float32 (attnx's one dtype label)."""
        from attnx._checks import dtype_name

        return dtype_name(array)


@pytest.fixture
def attnx_backend(request: pytest.FixtureRequest) -> Iterator[BackendUnderTest]:
    """The backend under test (parametrized by the plugin), made the current
    backend for the test, so it runs even when another backend owns the same
    array type."""
    import attnx

    name = request.param
    try:
        backend = attnx._registry.get(name)
    except (ValueError, RuntimeError) as exc:
        pytest.skip(str(exc))
    device = request.config.getoption("--attnx-device", default=None)
    chunking_name, chunking = _chunking(request, name, backend)
    if chunking_name != AS_MADE:
        # where a failure shows: the inputs' cut, to rerun it with --chunking
        request.node.add_report_section("call", "attnx", f"inputs cut as {chunking_name!r} (--chunking)")
    with attnx.use_backend(name):
        yield BackendUnderTest(name, backend, device, tuple(backend.float_dtypes), chunking, chunking_name)


def _chunking(request: pytest.FixtureRequest, name: str, backend: Any) -> tuple[str, Any]:
    """The chunking this test cuts its inputs by: the one asked for, else
    the backend's chunkings taking turns over the tests (by a hash of the
    test's id, so a test is cut the same way in every run)."""
    import zlib

    chunkings = {AS_MADE: None, **dict(backend.test_chunkings())}
    asked = request.config.getoption("--attnx-chunking", default=None)
    if asked is not None:
        if asked not in chunkings:
            pytest.fail(f"--chunking {asked!r}: backend {name!r} declares {', '.join(map(repr, chunkings))}")
        return asked, chunkings[asked]
    names = list(chunkings)
    chosen = names[zlib.crc32(request.node.nodeid.encode()) % len(names)]
    return chosen, chunkings[chosen]


# -- the summary per operation ----------------------------------------------

_OUTCOMES: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_SKIP_REASONS: dict[str, set[str]] = defaultdict(set)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    backend = _keyword_value(report, "attnx_backend:")
    if backend is not None and report.when == "call" and not report.skipped:
        _RAN_COUNTS[backend] += 1
    operation = _operation_of(report)
    if operation is None:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
        _OUTCOMES[operation][outcome] += 1
        if report.skipped and isinstance(report.longrepr, tuple):
            _SKIP_REASONS[operation].add(str(report.longrepr[2]).removeprefix("Skipped: "))


def _operation_of(report: pytest.TestReport) -> str | None:
    return _keyword_value(report, "attnx_op:")


def _keyword_value(report: pytest.TestReport, prefix: str) -> str | None:
    for key in report.keywords:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


def read_xfails(path: str) -> dict[str, str]:
    """``{test-id fragment: reason}`` from a known-failures file.

    Each line names a fragment of the test ids to mark (``test_positional.py::
    test_rotary``, ``[mylib-float16]``), optionally followed by ``# reason``;
    blank lines and lines starting with ``#`` are ignored.
    """
    entries = {}
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            fragment, _, reason = line.partition("#")
            if fragment.strip():
                entries[fragment.strip()] = reason.strip() or f"listed in {path}"
    return entries


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "attnx_backend" in callspec.params:
            # A keyword travels with the test's reports, so the count works
            # where another process collected and ran it (pytest-xdist).
            item.keywords[f"attnx_backend:{callspec.params['attnx_backend']}"] = True
        marker = item.get_closest_marker("attnx_operation")
        if marker is not None:
            item.keywords[f"attnx_op:{marker.args[0]}"] = True
    path = config.getoption("--attnx-xfails", default=None)
    if not path:
        return
    # Known failures are xfailed, not skipped: they still run, and an XPASS
    # says when one can come off the list.
    unused = read_xfails(path)
    entries = dict(unused)
    for item in items:
        # "test_file.py::test_name[params]", whatever the rootdir made of the node id.
        test_id = f"{item.path.name}::{item.name}"
        for fragment, reason in entries.items():
            if fragment in test_id or fragment in item.nodeid:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
                unused.pop(fragment, None)
    for fragment in unused:
        config.issue_config_time_warning(
            pytest.PytestConfigWarning(f"attnx known-failures entry matches no test: {fragment!r} ({path})"),
            stacklevel=2,
        )


def untested_backends(config: pytest.Config) -> list[str]:
    """Selected backends for which no test ran (allowed unavailable ones aside)."""
    names = explicit_selection(config)
    if not names:
        return []
    allowed = config.getoption("--attnx-allow-unavailable", default=False)
    import attnx

    available = {info.name for info in attnx._registry.info(names) if info.available}
    return [n for n in names if _RAN_COUNTS[n] == 0 and not (allowed and n not in available)]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == pytest.ExitCode.OK and untested_backends(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    untested = untested_backends(terminalreporter.config)
    if untested:
        terminalreporter.section("attnx conformance: nothing tested", red=True)
        for name in untested:
            terminalreporter.write_line(f"no test ran for backend {name!r}: the run fails", red=True)
    if not _OUTCOMES:
        return
    write = terminalreporter.write_line
    terminalreporter.section("attnx conformance, per operation")
    for operation in sorted(_OUTCOMES):
        counts = _OUTCOMES[operation]
        text = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped", "xfailed") if counts[k])
        write(f"{operation:32s} {text}")
        for reason in sorted(_SKIP_REASONS[operation]):
            write(f"{'':32s}   skipped: {reason}")
