"""How the bytes move once the ranks have agreed: the executors of each collective, the fusion
buffer, the explicit ring, Adasum, and the backends (MPI, torch.distributed, shared memory) behind one
small interface."""
