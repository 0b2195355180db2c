"""The launch commands of ``examples/``, exactly as a user types them from the repository root.

``tests/test_examples.py`` runs every one of them, in this order (each resume command after the run
whose checkpoints it continues from); ``examples/README.md`` lists them, and the docs' test checks the
shell blocks of the docs against this list.
"""

#: every command of examples/README.md, in the order tests/test_examples.py runs them
EXAMPLE_COMMANDS = [
    "hvpsrun -np 2 python examples/pytorch_train.py --epochs 2 --steps 8",
    "hvpsrun -np 3 --max-restarts 3 --checkpoint-dir checkpoints/pytorch_train "
    "python examples/pytorch_train.py --epochs 3 --steps 8 --resume",
    "torchrun --standalone --nproc-per-node=2 examples/pytorch_train.py --epochs 1 --steps 8 "
    "--checkpoint-dir checkpoints/torchrun",
    "hvpsrun -np 2 python examples/keras_fit.py --epochs 2",
    "hvpsrun -np 2 python examples/tf_gradient_tape.py --steps 20",
    "hvpsrun -np 2 --min-np 1 --max-np 3 --host-discovery-script examples/discover_hosts.sh "
    "python examples/pytorch_elastic.py --epochs 3",
    "hvpsrun -np 2 --min-np 1 --max-np 3 --host-discovery-script examples/discover_hosts.sh "
    "python examples/keras_elastic.py --epochs 3",
    "mpirun -np 2 python examples/sharded_store.py --epochs 2 --steps 10",
    "hvpsrun -np 2 python examples/compression.py --compression topk",
    "hvpsrun -np 2 python examples/compression.py --compression powersgd",
]
