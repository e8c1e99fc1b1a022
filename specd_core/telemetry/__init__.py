"""Observability shared by the services: OpenTelemetry tracing (tracing) and
the Prometheus endpoint with vLLM-compatible metric names (metrics)."""
