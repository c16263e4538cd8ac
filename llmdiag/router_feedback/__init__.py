"""router_feedback: health score, balancer, error classification, node-agent penalties (SPEC section 6).

The output formats live in :mod:`llmdiag.exporters`, the request paths in :mod:`llmdiag.gateway`
and :mod:`llmdiag.picker`."""
