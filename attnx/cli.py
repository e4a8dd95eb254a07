"""The ``attnx`` command line: ``backends``, ``demo``, ``conformance``, ``bench``.

Every user mistake (an unknown backend, a size of 0, an unknown operation)
is found before any work starts and reported as one line on stderr with
exit status 2, as argparse reports its own errors.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import NoReturn

from attnx._table import format_table

#: Float dtypes ``attnx bench`` can time (a backend must declare the one asked for).
BENCH_DTYPES = ("float16", "bfloat16", "float32", "float64")


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line: ``attnx bench: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every option's default after its help (unless the help states it);
    each command on one line; the descriptions' line breaks kept."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=28, width=min(110, max(80, _terminal_width())))

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (argparse.SUPPRESS, None) or not action.option_strings:
            return text
        default = action.default
        if isinstance(default, list):
            default = " ".join(map(str, default))
        elif isinstance(default, bool):
            default = "off" if not default else "on"
        return f"{text} (default: {default})"


def _terminal_width() -> int:
    import shutil

    return shutil.get_terminal_size().columns


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _usable_backend(name: str, parser: argparse.ArgumentParser, option: str) -> object:
    """The registered, available backend ``name``, or a one-line usage error."""
    import attnx

    try:
        return attnx._registry.get(name)
    except (ValueError, attnx.BackendUnavailableError) as exc:
        parser.error(f"argument {option}: {exc}")


def cmd_backends(args: argparse.Namespace) -> int:
    import attnx

    rows = [
        (
            info.name,
            "yes" if info.available else "no",
            info.version or "",
            ", ".join(info.devices),
            info.distribution or "",
            info.reason or "",
        )
        for info in attnx.list_backends()
    ]
    print(format_table(("backend", "available", "version", "devices", "from", "reason"), rows))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    _usable_backend(args.backend, args.parser, "--backend")
    import numpy as np

    import attnx

    print("attnx", attnx.__version__, "- backends on this machine:\n")
    cmd_backends(args)
    backend = args.backend
    print(f"\nSelf-attention over 5 tokens on the {backend!r} backend, causal, last sequence padded to 3 tokens.")
    rng = np.random.default_rng(0)
    tokens = attnx.asarray(rng.standard_normal((2, 5, 4)), dtype="float32", backend=backend)
    lengths = attnx.asarray(np.array([5, 3]), backend=backend)
    output, weights = attnx.scaled_dot_product_attention(
        tokens, tokens, tokens, is_causal=True, key_lengths=lengths, return_weights=True
    )
    weights = attnx.to_numpy(weights)
    for index, title in enumerate(("sequence 0 (5 tokens)", "sequence 1 (3 tokens, 2 padding)")):
        print(f"\nweights, {title}: row = query, column = key; each row sums to 1")
        for row in weights[index]:
            print("  " + " ".join(f"{w:5.2f}" for w in row) + f"   sum {row.sum():4.2f}")
    print(
        f"\noutput: {type(output).__module__}.{type(output).__name__} {tuple(output.shape)} {output.dtype}."
        "\nThe future (above the diagonal) and the padding (last two keys of sequence 1) get weight 0."
    )
    return 0


def cmd_conformance(args: argparse.Namespace) -> int:
    try:
        import hypothesis  # noqa: F401
        import pytest
    except ImportError as exc:
        args.parser.error(f"needs the test extra: pip install '.[test]' in attnx's clone ({exc})")
    from attnx_conformance.plugin import selection_problem

    problem = selection_problem(
        args.names, args.device, args.allow_unavailable, flag="--allow-unavailable", chunking=args.chunking
    )
    if problem is not None:
        args.parser.error(problem)
    if args.coverage:
        import attnx
        from attnx_conformance.coverage import report

        complete = True
        for name in args.names:
            text, whole = report(attnx._registry.get(name))
            print(text)
            complete &= whole
        return 0 if complete else 1
    # attnx is imported already (this command), so pytest cannot rewrite its
    # asserts: expected.  No cache and no benchmark folder in the user's folder.
    command = [
        "--pyargs",
        "attnx_conformance",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:benchmark",
        "-q",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
    ]
    for name in args.names:
        command += ["--attnx-backend", name]
    if args.device is not None:
        command += ["--attnx-device", args.device]
    if args.allow_unavailable:
        command += ["--attnx-allow-unavailable"]
    if args.chunking is not None:
        command += ["--attnx-chunking", args.chunking]
    return int(pytest.main([*command, *args.pytest_args]))


def _check_bench_arguments(args: argparse.Namespace) -> None:
    """Every backend usable, with the dtype and device asked for: before any case runs."""
    from attnx.backend import device_label

    for name in args.backends:
        backend = _usable_backend(name, args.parser, "--backends")
        if args.dtype not in backend.float_dtypes:
            args.parser.error(
                f"argument --dtype: backend {name!r} has no {args.dtype} (its float dtypes: {', '.join(backend.float_dtypes)})"
            )
        if args.device is not None:
            listed = [device_label(d) for d in backend.devices()]
            if args.device not in listed:
                args.parser.error(
                    f"argument --device: backend {name!r} has no device {args.device!r}; its devices: {', '.join(listed)}"
                )


def cmd_bench(args: argparse.Namespace) -> int:
    from attnx.benchmark import BASELINES, GRID, GRID_BASELINE

    # --grid fills in what was not given: the shapes of issue-sized workloads
    for name, default, grid in (
        ("batch", [1], GRID["batch"]),
        ("sizes", [128, 256, 512, 1024, 2048], GRID["sizes"]),
        ("head_dim", [64], GRID["head_dim"]),
    ):
        if getattr(args, name) is None:
            setattr(args, name, list(grid if args.grid else default))
    if args.grid and (args.no_baselines or args.baselines is not None and GRID_BASELINE not in args.baselines):
        args.parser.error(f"argument --grid: its report is the ratio to {GRID_BASELINE}, a baseline it needs")
    for baseline in args.baselines or ():
        if importlib.util.find_spec(BASELINES[baseline]) is None:
            args.parser.error(f"argument --baselines: {baseline} needs {BASELINES[baseline]}, which is not installed")
    if args.grid and importlib.util.find_spec(BASELINES[GRID_BASELINE]) is None:
        args.parser.error(
            f"argument --grid: its report is the ratio to {GRID_BASELINE}, which needs {BASELINES[GRID_BASELINE]} installed"
        )
    if args.dask_workers and "dask" not in args.backends:
        args.parser.error("argument --dask-workers: it runs the dask backend; add dask to --backends")
    if args.dask_workers and importlib.util.find_spec("distributed") is None:
        args.parser.error("argument --dask-workers: it needs dask.distributed (pip install '.[dask]' in attnx's clone)")
    _check_bench_arguments(args)
    from pathlib import Path

    from attnx import benchmark

    warning = benchmark.load_warning(args.threads)
    if warning is not None:
        print(f"attnx bench: warning: {warning}", file=sys.stderr)
    # The grid compares with the libraries a user would pick instead; the
    # textbook version's (B, H, n, n) scores would not fit in memory there.
    if args.baselines is not None:
        baselines = args.baselines
    else:
        baselines = [] if args.no_baselines or args.grid else ["numpy-textbook"]
        for baseline, module in benchmark.BASELINES.items():
            if baseline != "numpy-textbook" and not args.no_baselines and importlib.util.find_spec(module) is not None:
                baselines.append(baseline)
    operations = args.operations
    if (args.kv_heads is not None or args.queries != 1) and "decode" not in operations:
        args.parser.error("--kv-heads and --queries shape the decode operation: add it to --operations")
    if args.kv_heads is not None and args.heads % args.kv_heads:
        args.parser.error(f"--kv-heads must divide --heads = {args.heads}, got {args.kv_heads}")
    if args.backward:
        wrong = [op for op in operations if op not in benchmark.BACKWARD and op not in benchmark.BACKWARD.values()]
        if wrong:
            args.parser.error(f"--backward times sdpa and sdpa_causal only, got --operations {' '.join(wrong)}")
        operations = [benchmark.BACKWARD.get(op, op) for op in operations]
        baselines = [b for b in baselines if b in ("torch-sdpa", "jax-sdpa")]  # the ones with a backward
    cases = benchmark.plan(
        args.backends,
        operations,
        args.sizes,
        batch=args.batch,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        repeat=args.repeat,
        baselines=baselines,
        device=args.device,
        threads=args.threads,
        dask_workers=args.dask_workers or (),
        window=args.window,
        kv_heads=args.kv_heads,
        queries=args.queries,
    )
    results = benchmark.sweep(cases, rounds=args.rounds)
    benchmark.print_table(results, grid=args.grid)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    command = "attnx bench " + " ".join(args.argv)
    (folder / "results.md").write_text(benchmark.markdown(results, command.strip(), grid=args.grid, rounds=args.rounds))
    (folder / "run.json").write_text(json.dumps(benchmark.machine_record(command.strip()), indent=1))
    (folder / "results.json").write_text(
        json.dumps(
            [
                {
                    **asdict(r.case),
                    "measured_dtype": benchmark.measured_dtype(r.case),
                    "median_s": r.median_s,
                    "times_s": r.times_s,
                    "peak_bytes": r.peak_bytes,
                    "gflops": r.gflops,
                    "error": r.error,
                }
                for r in results
            ],
            indent=1,
        )
    )
    plots = benchmark.plot(results, folder)
    print(
        f"\nwrote {folder / 'results.md'}, {folder / 'results.json'}, {folder / 'run.json'}"
        + "".join(f", {p}" for p in plots)
    )
    if not plots:
        print("(no plots: pip install '.[bench]' in attnx's clone for matplotlib)")
    print(
        "Read it: 'x fastest baseline' is the time over the fastest baseline at the same size "
        "(below 1 = faster); the time plot's slope near 2 is attention's O(n^2)."
    )
    return 0 if all(r.error is None for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    from attnx import __version__
    from attnx.benchmark import BASELINES, OPERATIONS

    parser = _Parser(prog="attnx", description=__doc__, formatter_class=_Help)
    parser.add_argument("--version", action="version", version=f"attnx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of the commands below")
    summaries: list[tuple[str, str]] = []

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        # Listed in the epilog, one line each (argparse wraps long command names).
        summaries.append((name, help))
        parser = sub.add_parser(name, description=description or help, formatter_class=_Help)
        parser.set_defaults(parser=parser)  # for one-line errors found after parsing
        return parser

    command("backends", "list the registered backends, with why any is unavailable").set_defaults(run=cmd_backends)

    demo = command("demo", "a small attention example on a backend, with its weights")
    demo.add_argument("--backend", default="numpy", help="the backend to run on")
    demo.set_defaults(run=cmd_demo)

    conformance = command(
        "conformance",
        "run the conformance suite on backends",
        "Run attnx's conformance suite on the named backends; options attnx does not know "
        "(-x, -k EXPR) go to pytest.  A backend that is not registered or can't run here, a device "
        "it does not list, or a run in which no test ran for a backend, is an error.",
    )
    conformance.add_argument(
        "names", nargs="+", metavar="BACKEND", help="backends to test, as `attnx backends` lists them"
    )
    conformance.add_argument(
        "--device",
        default=None,
        help="run on this device, as `attnx backends` lists it (cuda:0); default: the backend's default device",
    )
    conformance.add_argument(
        "--allow-unavailable",
        action="store_true",
        help="skip, with the reason, a backend that can't run here (cupy without a GPU) instead of failing",
    )
    conformance.add_argument(
        "--coverage",
        action="store_true",
        help="list the standard's functions, operators and arguments attnx uses that the backend lacks or refuses, "
        "in seconds, and run no test",
    )
    conformance.add_argument(
        "--chunking",
        default=None,
        metavar="NAME",
        help="cut every input this way, one of the backend's test_chunkings() (Dask: 'chunks of 2', 'uneven') "
        "or 'as made'; default: the tests take turns over them",
    )
    conformance.set_defaults(run=cmd_conformance)

    bench = command("bench", "time and peak memory across backends, with a report and plots")
    bench.add_argument("--backends", nargs="+", default=["numpy"], metavar="NAME", help="attnx backends to time")
    bench.add_argument(
        "--operations",
        nargs="+",
        default=["sdpa", "sdpa_causal"],
        choices=OPERATIONS,
        metavar="OP",
        help=f"operations to time: {', '.join(OPERATIONS)}",
    )
    bench.add_argument(
        "--sizes",
        nargs="+",
        type=_positive_int,
        default=None,
        metavar="N",
        help="sequence lengths (n = m) (default: 128 256 512 1024 2048; with --grid 128 512 2048 8192)",
    )
    bench.add_argument(
        "--batch",
        nargs="+",
        type=_positive_int,
        default=None,
        metavar="B",
        help="batch sizes (default: 1; with --grid 1 16 64)",
    )
    bench.add_argument("--heads", type=_positive_int, default=8, help="heads H")
    bench.add_argument(
        "--head-dim",
        nargs="+",
        type=_positive_int,
        default=None,
        metavar="D",
        help="widths d of each head (default: 64; with --grid 64 128)",
    )
    bench.add_argument(
        "--grid",
        action="store_true",
        help="the grid batch 1 16 64 x n 128 512 2048 8192 x d 64 128 (unless given), "
        "reported as ratios to torch-sdpa; the whole grid takes hours on 2 cores",
    )
    bench.add_argument("--dtype", default="float32", choices=BENCH_DTYPES, help="float dtype of the inputs")
    bench.add_argument("--repeat", type=_positive_int, default=5, help="timed calls per case, after one warm-up")
    bench.add_argument(
        "--rounds",
        type=_positive_int,
        default=1,
        help="time the implementations of each shape in turn this many times (A, B, A, B, ...) and "
        "report each one's median round, so that the machine's drift falls on all alike",
    )
    bench.add_argument(
        "--threads", type=_positive_int, default=None, help="limit BLAS/PyTorch threads; default: all cores"
    )
    bench.add_argument(
        "--device",
        default=None,
        help="for GPU backends, as `attnx backends` lists it (cuda:0), for every array of the timed calls and "
        "the PyTorch and JAX baselines' too; default: the backend's default device",
    )
    bench.add_argument(
        "--baselines",
        nargs="+",
        default=None,
        choices=list(BASELINES),
        metavar="NAME",
        help=f"baselines to time: {', '.join(BASELINES)} (default: those installed; the textbook only without --grid)",
    )
    bench.add_argument(
        "--no-baselines",
        action="store_true",
        help="skip the baselines (textbook NumPy; PyTorch and JAX SDPA where installed)",
    )
    bench.add_argument(
        "--dask-workers",
        nargs="+",
        type=_positive_int,
        default=None,
        metavar="W",
        help="run the dask backend on local clusters of W single-threaded worker processes each "
        "(e.g. 1 2), reporting the speed-up; needs dask in --backends and dask.distributed",
    )
    bench.add_argument(
        "--window",
        type=_positive_int,
        default=256,
        help="keys each query attends before its own, for the sliding_window operation (flex_attention)",
    )
    bench.add_argument(
        "--kv-heads",
        type=_positive_int,
        default=None,
        help="key/value heads for the decode operation, grouped where fewer than --heads (default: --heads)",
    )
    bench.add_argument(
        "--queries",
        type=_positive_int,
        default=1,
        help="new queries per sequence for the decode operation (more than 1: a causal chunk of prefill); "
        "--sizes gives the cache's length",
    )
    bench.add_argument(
        "--backward",
        action="store_true",
        help="time training steps: sdpa and sdpa_causal with their backward (attnx.vjp on attnx's backends, "
        "autograd on the torch-sdpa and jax-sdpa baselines), the output as its own cotangent",
    )
    bench.add_argument("--out", default="attnx-bench", help="folder for results.md, results.json and plots")
    bench.set_defaults(run=cmd_bench)
    width = max(len(name) for name, _ in summaries)
    parser.epilog = "commands:\n" + "\n".join(f"  {name.ljust(width)}  {text}" for name, text in summaries)
    parser.epilog += "\n\n'attnx COMMAND --help' shows a command's options and their defaults."
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Options attnx does not know (-x, -k EXPR, ...) go on to pytest.
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "conformance":
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.pytest_args = [a for a in extra if a != "--"]
    args.argv = list(sys.argv[2:] if argv is None else argv[1:])
    try:
        return args.run(args)
    except BrokenPipeError:  # `attnx backends | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
