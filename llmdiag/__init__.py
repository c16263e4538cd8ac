"""llmdiag: find hidden overload on LLM-inference GPU hosts and feed it back into routing."""

__version__ = "0.1.0"
