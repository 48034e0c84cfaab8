"""What an operator sees of a running server: Prometheus metrics, the live dashboard, traces and the
request log, and the routes that serve them."""
