"""The model layer: torch models, scopes, perturbation, replay, quantized and ternary forms."""
