"""The running system: wiring, the tick loop, the agent state, the HTTP and agent-check servers.

Everything long-running sits here so that ``llmdiag agent``, ``llmdiag top`` and the
one-shot commands (``collect``, ``diagnose``, ``demo``) share one loop (SPEC section 1).
"""
