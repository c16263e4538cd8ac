"""router_feedback: health score, balancer, error classification, exporters, gateway (SPEC section 6)."""
