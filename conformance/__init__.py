"""attnx's conformance suite: any backend, ours or a third party's.

Run it against a backend with one command, no checkout needed::

    pytest --pyargs attnx_conformance --attnx-backend NAME
    # or
    attnx conformance NAME

Every test compares the backend with float64 NumPy references written
straight from the formulas (:mod:`attnx_conformance.reference`), checks the
contract's properties with hypothesis, and checks that bad input raises the
same exceptions on every backend.
"""
