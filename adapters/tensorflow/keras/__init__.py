"""Keras 3 adapter with Horovod's API (in progress)."""
