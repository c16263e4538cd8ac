"""Analyzers: rolling windows, baselines, correlation, diagnosis rules and penalties (SPEC 3.3, 5).

See :mod:`llmdiag.analyzers.analyzer` for the API and docs/diagnoses.md for the catalog.
"""

from llmdiag.analyzers.analyzer import AnalysisResult, Analyzer
from llmdiag.analyzers.penalties import BackendHealth, backend_health

__all__ = ["AnalysisResult", "Analyzer", "BackendHealth", "backend_health"]
