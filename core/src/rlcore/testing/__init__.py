"""Test kit for rlcore and its plugins: tiny models, fixtures and conformance tests.

A third-party plugin runs the conformance tests in its own CI; see :mod:`rlcore.testing.conformance`.
"""
