"""Test kit for rlcore and its plugins: tiny models, fixtures, conformance tests and the fault plugin; may import every package below cli.

A third-party plugin runs the conformance tests in its own CI; see :mod:`rlcore.testing.conformance`.
"""
