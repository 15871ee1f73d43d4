"""`spec-router epp`: a Gateway API Inference Extension endpoint picker (Envoy ext_proc) over the router's pools."""
