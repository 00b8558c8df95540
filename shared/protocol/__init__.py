"""The protocol layer: everything both sides must agree on, in numpy alone."""
