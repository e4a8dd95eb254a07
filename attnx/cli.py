"""The ``attnx`` command line: ``backends``, ``demo``, ``conformance``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


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
    import pytest

    # attnx is imported already (this command), so pytest cannot rewrite its asserts: expected.
    command = ["--pyargs", "attnx_conformance", "-p", "no:cacheprovider", "-q", "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    for name in args.names:
        command += ["--attnx-backend", name]
    return int(pytest.main([*command, *args.pytest_args]))


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
    conformance.set_defaults(run=cmd_conformance)
    # Options attnx does not know (-x, -k EXPR, ...) go on to pytest.
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "conformance":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.pytest_args = [a for a in extra if a != "--"]
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
