"""The example command lines the documentation shows, each of which the examples' test runs as written.

tests/test_docs_snippets.py checks that every ``<!-- snippet: example -->`` block of the README and the
docs holds only commands from this list, so a page cannot show a command that CI does not run.
"""

EXAMPLE_COMMANDS = [
    "hvpsrun -np 2 python examples/pytorch_train.py",
    "hvpsrun -np 2 python examples/keras_fit.py",
    "hvpsrun -np 2 python examples/tf_gradient_tape.py",
    "hvpsrun -np 2 --min-np 1 --max-np 2 -H localhost:2 python examples/pytorch_elastic.py",
    "hvpsrun -np 2 python examples/sharded_store.py",
    "hvpsrun -np 2 python examples/compression.py",
]
