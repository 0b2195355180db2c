"""Framework adapters with Horovod's API: ``import hvps.adapters.torch as hvd``."""
