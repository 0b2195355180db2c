"""Outer tests of the TensorFlow 2 / Keras 3 adapter: the inner modules
``tests/mpi/mpi_tf_ops.py``, ``mpi_tf_train.py``, ``mpi_tf_compat.py`` (Horovod compatibility) and
``mpi_tf_overlap.py`` (gradient buckets overlapping the backward pass), ``mpi_tf_elastic.py``
(``hvd.elastic``'s Keras state, retry loop and callbacks) and ``mpi_tf_sharded.py`` (the Keras
``ShardedOptimizer``, ZeRO stage 1-2) under mpirun with 2 and 3 ranks
and ``mpi_tf_compression.py`` with 3 (clean on every rank; the cases at one rank count share one
job, so TensorFlow is imported once per rank), plus single-process checks in subprocesses (the
outer run never imports TensorFlow)."""

import importlib.util
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, case

NPS = [2, 3]
HAVE_TF = importlib.util.find_spec("tensorflow") is not None and importlib.util.find_spec("keras") is not None
needs_tf = pytest.mark.skipif(not HAVE_TF, reason="the 'tensorflow' extra (tensorflow-cpu) is not installed")

# inner module -> hard timeout in seconds
CASES = {"ops": ("mpi_tf_ops.py", 300), "train": ("mpi_tf_train.py", 300), "compat": ("mpi_tf_compat.py", 300),
         "overlap": ("mpi_tf_overlap.py", 300), "elastic": ("mpi_tf_elastic.py", 240),
         "sharded": ("mpi_tf_sharded.py", 240)}


# Ranks trace their tf.functions (model.fit's train function: seconds) at different speeds on a
# loaded box: the core's 3 s test default for the stall check would report that skew as a stall.
JOB_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "HVPS_STALL_CHECK_TIME_SECONDS": "60"}


def _tf_cases(np_, case_name):
    module, timeout = CASES[case_name]
    # the others give TensorFlow one thread per pool (hvd.set_threads(1), fixed for the process's life);
    # overlap needs its default pools (a bucket starts while the backward still runs): a job of its own
    job = "default-threads" if case_name == "overlap" else ""
    return [(np_, case(case_name, module, timeout=timeout, job=job))] if HAVE_TF else []


# At 3 ranks only: ops (Horovod's TensorFlow suite, tests/test_conformance.py, runs every op at 2) and overlap (a
# job of its own: the bucket logic does not depend on the rank count; 3 is where sums depend on the order)
THREE_RANKS_ONLY = ("ops", "overlap")
TF_JOBS = [(np_, name) for np_ in NPS for name in CASES if np_ == 3 or name not in THREE_RANKS_ONLY]


@needs_tf
@pytest.mark.inner_cases(cases=_tf_cases, env=JOB_ENV)
@pytest.mark.parametrize("np_, case_name", TF_JOBS, ids=[f"np{n}-{name}" for n, name in TF_JOBS])
def test_tensorflow_inner_module(np_, case_name, inner_results):
    inner_results[case_name].assert_all_passed(min_passed=5)


@needs_tf
@pytest.mark.inner_cases(cases=lambda: [(3, case("compression", "mpi_tf_compression.py", timeout=300))] if HAVE_TF else [],
                         env=JOB_ENV)
def test_tensorflow_compression(inner_results):
    """Compressed gradients (top-k, int8) through the tape and the Keras optimizer. Three ranks only:
    that is where summing in rank order is what keeps the ranks bit-identical (two ranks' sums commute),
    and every TF rank costs ~10 s of import on a small box."""
    inner_results["compression"].assert_all_passed(min_passed=5)


def _python(code):
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO_ROOT), capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO_ROOT), "TF_CPP_MIN_LOG_LEVEL": "2",
                                            "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_core_and_torch_adapter_never_import_tensorflow():
    out = _python("import sys, hvps\n"
                  "import importlib.util\n"
                  "if importlib.util.find_spec('torch'): import hvps.adapters.torch\n"
                  "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
    assert out.split() == ["False", "False"]


@needs_tf
def test_single_process_api():
    """World size 1 (MPI singleton): the facades, a tf.function allreduce, refusals with clear errors."""
    out = _python(
        "import keras, tensorflow as tf\n"
        "import hvps.adapters.tensorflow as hvd, hvps.adapters.tensorflow.keras as hk\n"
        "assert set(hvd.__all__) <= set(dir(hvd)) and set(hk.__all__) <= set(dir(hk))\n"
        "try:\n    hk.DistributedOptimizer(keras.optimizers.SGD(0.1))\nexcept hvd.HvpsError: print('uninit')\n"
        "hvd.init()\n"
        "y = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum))(tf.constant([1.0, 2.0]))\n"
        "print(y.numpy().tolist(), y.shape.as_list())\n"
        "try:\n    hk.DistributedOptimizer(object())\nexcept TypeError: print('typeerror')\n"
        "try:\n    hk.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0)\n"
        "except ValueError: print('valueerror')\n"
        "opt = hk.DistributedOptimizer(keras.optimizers.Adam(0.01), compression=hvd.Compression.fp16)\n"
        "again = hk.DistributedOptimizer.from_config(opt.get_config())\n"
        "topk = hk.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hk.Compression.topk(0.05))\n"
        "print(type(again.inner_optimizer).__name__, again.compression.name,\n"
        "      hk.DistributedOptimizer.from_config(topk.get_config()).compression.name)\n"
        "hvd.shutdown()\n")
    assert out.split("\n")[:5] == ["uninit", "[1.0, 2.0] [2]", "typeerror", "valueerror", "Adam fp16 topk(0.05)"], out


_OVERLAP_WARNING = (
    "import os, warnings\n"
    "os.environ['HVPS_TF_BUCKET_BYTES'] = '0'\n"  # one gradient per bucket: two buckets
    "import tensorflow as tf\n"
    "{threads}\n"  # before hvps's import, which gives TensorFlow 64 inter-op threads when nobody chose a number
    "import hvps.adapters.tensorflow as hvd\n"
    "hvd.init()\n"
    "w, b = tf.Variable([1.0, 2.0]), tf.Variable(3.0)\n"
    "@tf.function\n"
    "def step(x):\n"
    "    with tf.GradientTape() as tape:\n"
    "        loss = tf.reduce_sum(w * x) + b\n"
    # a predivide factor: one rank still reduces (without one, its gradients are returned as they are)
    "    return hvd.DistributedGradientTape(tape, gradient_predivide_factor=2.0).gradient(loss, [w, b])\n"
    "with warnings.catch_warnings(record=True) as seen:\n"
    "    warnings.simplefilter('always')\n"
    "    grads = step(tf.constant([4.0, 5.0]))\n"
    "    step(tf.constant([[4.0, 5.0]]))\n"  # traced again
    "print([g.numpy().tolist() for g in grads])\n"
    "print(sum('none of the 2 gradient buckets starts' in str(w.message) for w in seen))\n"
    "hvd.shutdown()\n")


@needs_tf
@pytest.mark.parametrize("threads, warnings_seen", [
    ("tf.config.threading.set_inter_op_parallelism_threads(1)", "1"),
    ("os.environ['TF_NUM_INTEROP_THREADS'] = '1'", "1"),
    ("tf.config.threading.set_inter_op_parallelism_threads(2)", "0"),
], ids=["config-1", "environment-1", "config-2"])
def test_a_graph_whose_buckets_cannot_overlap_the_backward_warns_once(threads, warnings_seen):
    """One inter-op thread (set in TensorFlow's config or by TF_NUM_INTEROP_THREADS) runs the backward inline
    before any bucket's start op: one warning per process, saying what to set; two threads let the buckets start
    during the backward, and nothing is said."""
    out = _python(_OVERLAP_WARNING.format(threads=threads)).split("\n")
    assert out[:2] == ["[[4.0, 5.0], 1.0]", warnings_seen], out
