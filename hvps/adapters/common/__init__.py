"""What the framework adapters share, written once: op resolution (:mod:`.ops`), the checks of a
gradient wrapper's arguments (:mod:`.options`) and its compression controls (:mod:`.controls`).
Neither torch nor TensorFlow is imported here; scaling itself is ``hvps.core.scaling``."""
