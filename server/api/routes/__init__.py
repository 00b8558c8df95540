"""Route modules; each exposes `router`."""
