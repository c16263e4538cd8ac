"""The Envoy endpoint picker: Gateway API Inference Extension protocol over Envoy ext_proc."""
