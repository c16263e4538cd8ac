"""Pure output formats: the Prometheus collector, the penalties document, the agent-check reply.

Nothing here does IO: each function turns state into bytes or documents (SPEC 6.4).
"""
