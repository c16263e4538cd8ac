"""Collectors: one module per source; each returns typed samples and never prints (SPEC section 4)."""
