"""TensorFlow 2 adapter with Horovod's API (in progress)."""
