"""Analyzers: time windows, correlation, diagnosis rules and penalties (SPEC sections 3.3, 5)."""
