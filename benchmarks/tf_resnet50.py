"""Synthetic ResNet-50 training throughput with hvps on TensorFlow 2 / Keras 3
(``keras.applications.ResNet50(weights=None)``, random data). Same flags and
same JSON as ``benchmarks/pytorch_synthetic_benchmark.py`` (whose argument
parser, statistics and summary it reuses), e.g.::

    mpirun -np 2 --bind-to none --map-by slot python benchmarks/tf_resnet50.py \\
        --threads-per-rank 1 --compare-no-comm --baseline --json out/tf_resnet50.json

The distributed step is the user's loop: one ``tf.function`` with forward, loss,
``hvd.DistributedGradientTape(tape).gradient`` and ``apply_gradients``; the no-comm
step (also the plain loop of ``--compare-plain``) is the same function with a plain
``tf.GradientTape``. The tape reduces the gradients in ~25 MiB buckets
(``HVPS_TF_BUCKET_BYTES``), each started while the backward pass is still running
(``hvps/adapters/tensorflow/overlap.py``). The communication wait is the time the step
spends inside the hvps ops: the starts (submission only) and the finishes, which
block until their bucket is reduced (the exposed wait). ``--compression
none|fp16|bf16|int8|topk|dgc`` and ``--density`` pick the tape's gradient
compression (``--fp16-allreduce`` is ``--compression fp16``); the JSON then reports
bytes sent and received per step, the compression ratio and compress/decompress
time, as the PyTorch harness does. DGC runs with a momentum-free SGD (DGC applies
momentum itself) and no warm-up. ``--threads-per-rank`` sets TensorFlow's intra- and
inter-op pools, ``--inter-op-threads`` the inter-op pool alone: with one inter-op thread
TensorFlow's executor runs the backward pass inline and each bucket's start op only after
it (no overlap). ``--channels-last`` is accepted (Keras on TF is channels-last already).
``--epochs`` / ``--checkpoint-dir`` are the PyTorch harness's only.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Progress, write_json  # noqa: E402
from benchmarks.pytorch_synthetic_benchmark import (  # noqa: E402
    _summary,
    create_compression,
    energy_fields,
    parse_args,
    phase_runner,
    reference,
    result_header,
    run_baseline,
    run_phases,
    warm_up,
)
from hvps.metrics import record_samples  # noqa: E402


class Trainer:
    """One ResNet-50 replica; ``step()`` returns (step_s, comm_wait_s, forward_backward_s)."""

    def __init__(self, args: Any, hvd: Any | None, ranks: int) -> None:
        import keras
        import numpy as np
        import tensorflow as tf

        from hvps.adapters.tensorflow.tensors import comm_clock

        self.hvd, self.clock = hvd, comm_clock
        self.model = keras.applications.ResNet50(weights=None, input_shape=(args.image_size, args.image_size, 3),
                                                 classes=args.num_classes)
        # DGC applies momentum itself (momentum correction), so its optimizer has none.
        momentum = 0.0 if (hvd is not None and args.compression == "dgc") else 0.9
        self.opt = keras.optimizers.SGD(args.lr * ranks, momentum=momentum)
        self.opt.build(self.model.trainable_variables)
        if hvd is not None:
            hvd.broadcast_variables(self.model.variables, root_rank=0)
            hvd.broadcast_variables(self.opt.variables, root_rank=0)
        rng = np.random.default_rng(0)
        self.data = tf.constant(rng.standard_normal((args.batch_size, args.image_size, args.image_size, 3),
                                                    dtype=np.float32))
        self.target = tf.constant(rng.integers(0, args.num_classes, args.batch_size))
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=False)
        #: the gradient compression whose stats the harness reports (None in the plain loop)
        self.compression = create_compression(args) if hvd is not None else None
        compression = self.compression

        @tf.function(jit_compile=False)
        @tf.autograph.experimental.do_not_convert  # plain Python, nothing to convert
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, self.model(x, training=True))
            if hvd is not None:
                tape = hvd.DistributedGradientTape(tape, compression=compression)
            grads = tape.gradient(loss, self.model.trainable_variables)
            self.opt.apply_gradients(zip(grads, self.model.trainable_variables))
            return loss

        self.train_step = train_step

    def step(self) -> tuple[float, float, float]:
        before = self.clock.seconds
        t0 = time.perf_counter()
        self.train_step(self.data, self.target).numpy()
        step = time.perf_counter() - t0
        wait = self.clock.seconds - before if self.hvd is not None else 0.0
        if self.hvd is not None:
            record_samples(int(self.target.shape[0]))  # samples/s on the Grafana dashboard (hvps.metrics)
        return step, wait, step - wait


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.epochs is not None or args.checkpoint_dir:
        raise SystemExit("tf_resnet50.py: --epochs, --checkpoint-dir and --resume are the PyTorch harness's only")
    if args.cuda or args.amp:
        raise SystemExit("tf_resnet50.py: --cuda and --amp are the PyTorch harness's only (TensorFlow places ops "
                         "on a GPU by itself)")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads_per_rank)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads or args.threads_per_rank)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    hvd = None
    if not args.no_comm:
        import hvps.adapters.tensorflow as hvd
        hvd.init()
        assert hvd.size() == size and hvd.rank() == rank, "hvps and MPI disagree on rank/size"

    phases = args.rounds * 2 if reference(args) else 1
    total = args.num_iters * (phases + int(args.baseline and rank == 0))
    progress = Progress(total, rank, args.progress)
    tick, log = progress.tick, progress.log

    log(f"Model: {args.model} (keras.applications, TF {tf.__version__}), batch size {args.batch_size}, "
        f"image size {args.image_size}, ranks {size}, threads per rank {args.threads_per_rank} "
        f"(inter-op {args.inter_op_threads or args.threads_per_rank}), "
        f"compression {args.compression}" + (f" (density {args.density})" if args.compression in ("topk", "dgc")
                                             else ""))
    dist = Trainer(args, hvd, size) if hvd is not None else None
    local = Trainer(args, None, size) if (args.no_comm or reference(args) or args.baseline) else None
    warm_up(args, dist, local)

    phase = phase_runner(comm, args, tick)

    # Keras on TensorFlow is channels-last whatever --channels-last says
    result = dict(result_header(args, "tf_resnet50", size), channels_last=True, tensorflow=tf.__version__)
    main_res = run_phases(args, dist, local, phase, rank, log, result)
    run_baseline(args, comm, local, tick, main_res, result)
    progress.close()

    if rank == 0:
        result.update(energy_fields(main_res))
        _summary(result, main_res, log)
        write_json(args.json, result)
        print(json.dumps(result, default=float), flush=True)
    if hvd is not None:
        hvd.shutdown()
    comm.Free()
    return result if rank == 0 else None


if __name__ == "__main__":
    main()
