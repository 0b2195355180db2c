"""hvps benchmarks: ResNet-50 model, synthetic training harness, allreduce and fusion sweeps."""
