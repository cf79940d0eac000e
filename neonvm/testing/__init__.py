"""Helpers that drive the controller from tests, drills and benchmarks.

The product packages (neonvm/controller, leader, runner, api) never import this package;
tests/test_imports.py enforces it.
"""
