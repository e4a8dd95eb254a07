"""The ``attnx`` command line: ``backends``, ``demo``, ``conformance``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


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
    print(_table(("backend", "available", "version", "devices", "from", "reason"), rows))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
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
        print(f"attnx conformance needs the test extra: pip install 'attnx[test]' ({exc})", file=sys.stderr)
        return 2

    # attnx is imported already (this command), so pytest cannot rewrite its asserts: expected.
    command = [
        "--pyargs",
        "attnx_conformance",
        "-p",
        "no:cacheprovider",
        "-q",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
    ]
    for name in args.names:
        command += ["--attnx-backend", name]
    if args.device is not None:
        command += ["--attnx-device", args.device]
    return int(pytest.main([*command, *args.pytest_args]))


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib.util
    from pathlib import Path

    from attnx import benchmark

    baselines = [] if args.no_baselines else ["numpy-textbook"]
    for baseline, module in (("torch-sdpa", "torch"), ("jax-sdpa", "jax")):
        if not args.no_baselines and importlib.util.find_spec(module) is not None:
            baselines.append(baseline)
    cases = benchmark.plan(
        args.backends,
        args.operations,
        args.sizes,
        batch=args.batch,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        repeat=args.repeat,
        baselines=baselines,
        device=args.device,
        threads=args.threads,
    )
    results = benchmark.sweep(cases)
    benchmark.print_table(results)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    command = "attnx bench " + " ".join(args.argv)
    (folder / "results.md").write_text(benchmark.markdown(results, command.strip()))
    (folder / "results.json").write_text(
        json.dumps(
            [
                {
                    **asdict(r.case),
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
    print(f"\nwrote {folder / 'results.md'}, {folder / 'results.json'}" + "".join(f", {p}" for p in plots))
    if not plots:
        print("(no plots: pip install 'attnx[bench]' for matplotlib)")
    print(
        "Read it: 'x fastest baseline' is the time over the fastest baseline at the same size "
        "(below 1 = faster); the time plot's slope near 2 is attention's O(n^2)."
    )
    return 0 if all(r.error is None for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help="list the registered backends").set_defaults(run=cmd_backends)
    demo = sub.add_parser("demo", help="a small attention example with its weights")
    demo.add_argument("--backend", default="numpy")
    demo.set_defaults(run=cmd_demo)
    conformance = sub.add_parser(
        "conformance",
        help="run the conformance suite on backends (other options go to pytest)",
        description="Run attnx's conformance suite on the named backends; unknown options (-x, -k EXPR) go to pytest.",
    )
    conformance.add_argument("names", nargs="+", metavar="BACKEND")
    conformance.add_argument(
        "--device", help="run on this device, as `attnx backends` lists it (cuda:0); default: the backend's default"
    )
    conformance.set_defaults(run=cmd_conformance)
    bench = sub.add_parser("bench", help="time and peak memory across backends, with a report and plots")
    bench.add_argument("--backends", nargs="+", default=["numpy"], metavar="NAME")
    bench.add_argument(
        "--operations",
        nargs="+",
        default=["sdpa", "sdpa_causal"],
        metavar="OP",
        help="sdpa, sdpa_causal, multi_head_attention, additive_attention",
    )
    bench.add_argument(
        "--sizes",
        nargs="+",
        type=int,
        default=[128, 256, 512, 1024, 2048],
        metavar="N",
        help="sequence lengths (n = m)",
    )
    bench.add_argument("--batch", type=int, default=1)
    bench.add_argument("--heads", type=int, default=8)
    bench.add_argument("--head-dim", type=int, default=64)
    bench.add_argument("--dtype", default="float32")
    bench.add_argument("--repeat", type=int, default=5, help="timed calls per case, after one warm-up")
    bench.add_argument("--threads", type=int, default=None, help="limit BLAS/PyTorch threads")
    bench.add_argument("--device", default=None, help="for GPU backends, e.g. cuda:0")
    bench.add_argument(
        "--no-baselines",
        action="store_true",
        help="skip the baselines (textbook NumPy; PyTorch and JAX SDPA where installed)",
    )
    bench.add_argument("--out", default="attnx-bench", help="folder for results.md, results.json and plots")
    bench.set_defaults(run=cmd_bench)
    # Options attnx does not know (-x, -k EXPR, ...) go on to pytest.
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "conformance":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.pytest_args = [a for a in extra if a != "--"]
    args.argv = list(sys.argv[2:] if argv is None else argv[1:])
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
