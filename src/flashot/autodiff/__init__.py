"""Autograd for entropic OT: envelope-theorem gradients built on the streaming primitives."""
