"""REST API of the coordinator (versioned under /v1)."""
