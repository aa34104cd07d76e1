"""Optimizers: ortrain.optim.Lamb."""
