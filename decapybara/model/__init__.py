"""Model configs, weights, the backend-agnostic forward pass and weight codecs."""
