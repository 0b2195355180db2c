"""``ShardedOptimizer`` for Keras 3: ZeRO stage 1-2 on hvps's collectives (each rank keeps 1/N of the state).

The Keras counterpart of ``hvps.adapters.torch.sharded_optimizer``, reached the same way:
``hvd.DistributedOptimizer(opt, shard=True)`` (``import hvps.adapters.tensorflow.keras as hvd``) or
``ShardedOptimizer(opt)``, then ``model.compile(optimizer=...)`` / ``model.fit`` or a ``tf.GradientTape``
loop that calls ``apply_gradients``. Like the replicated Keras ``DistributedOptimizer`` it is a wrapper
optimizer whose ``apply`` (which ``apply_gradients`` and ``model.fit``'s train step call) does the work.

1. **Buckets** (at ``build``): the trainable variables, in the order Keras passes them, are laid out into
   flat buckets of one dtype (at most ``bucket_bytes``), each padded to a multiple of N. Rank r owns elements
   ``[r * L/N, (r+1) * L/N)`` of a bucket of padded length L, held in one flat ``keras.Variable`` per bucket
   (the shard). The layout is checked across ranks once (an allgather of each variable's shape and dtype): a
   difference raises ``HvpsError`` naming the variable and the ranks.
2. **apply(grads, variables)**: the gradients of each bucket are packed into one flat padded tensor
   (zeros for a ``None`` gradient), compressed (fp16/bf16) and reduce-scattered (Average by default), one
   grouped reduce-scatter for all buckets: each rank receives only its shard of the averaged gradient.
   This rank's block of the current variables is copied into the shards (the variables are the truth, so
   a broadcast after wrapping is seen), an inner optimizer steps the shards only, and the updated shards
   are all-gathered (one grouped allgather) and assigned back into the model's variables.

The inner optimizer is ``type(opt).from_config(opt.get_config())``: a fresh instance of the user's class
with the same hyper-parameters, built over the shard variables, so its momentum or Adam moments exist for
1/N of the elements. ``learning_rate`` and ``iterations`` are the inner optimizer's (learning-rate callbacks
work). ``variables`` are only those that are the same on every rank (step counts, learning rates), so that
``BroadcastGlobalVariablesCallback`` (which, with ``model.fit``, broadcasts after the first batch, once the
optimizer is built) never overwrites another rank's shard with the root's;
this rank's shard of the state is ``shard_state_variables``.

Element-wise optimizers only (SGD, Adam, AdamW, RMSprop, Adagrad, ...): an update that couples the elements
of one variable would see flat shards. With element-wise kernels the shard update computes each element as
the unsharded optimizer does, so equal averaged gradients give bit-identical weights.

Not supported (``ValueError`` at construction, naming the combination): ``op=Adasum`` or an op other than
Average/Sum; compressions other than none, fp16 and bf16; ``backward_passes_per_step > 1`` (use the
optimizer's own ``gradient_accumulation_steps``); ``clipnorm`` / ``global_clipnorm`` (a per-variable or
global norm, which a shard cannot see; ``clipvalue`` is element-wise and works); ``use_ema``; variables
excluded from weight decay; a ``LossScaleOptimizer`` (its skip decision would differ between shards); an
optimizer already built; ``groups`` / ``num_groups``. A sparse gradient (``tf.IndexedSlices``) raises
``ValueError`` naming the variable unless ``sparse_as_dense=True``.

Eager and ``tf.function``: the collectives are ``tf.numpy_function`` ops inside a graph (as every hvps
TensorFlow collective), so ``model.fit`` works with its compiled train function (``jit_compile=False``:
XLA cannot run them) as well as with ``run_eagerly=True``. Unlike the replicated optimizer, the
reduce-scatter does not overlap the backward pass: it starts in ``apply``, once every gradient exists.

Checkpoints: ``hvd.callbacks.CheckpointCallback`` saves this rank's shard of the state as a file of its own
beside each version, with a manifest in the version (:meth:`shard_layout` says how the variables lie in the
buckets); its ``restore`` re-shards it for a ``ShardedOptimizer`` at any rank count, or consolidates it into a
plain Keras optimizer (:mod:`hvps.adapters.tensorflow.keras.sharded_checkpoint`). Keras's own checkpoints
(``model.save``, ``tf.train.Checkpoint``) save ``variables`` and leave the shards out.

Elastic: ``hvd.elastic.KerasState(model, optimizer)`` keeps this rank's shard of the state and a copy of a
neighbour's at each commit, and re-shards it when the world changes size (:meth:`world`, :meth:`relayout`,
:meth:`shard_state`, :meth:`load_shard_state`; ``hvps.adapters.tensorflow.elastic``).
"""

from __future__ import annotations

from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

import hvps
from hvps import HvpsError, global_process_set
from hvps.adapters.common import options
from hvps.adapters.common.sharding import Signature, check_same_everywhere, sharded_op
from hvps.compression import CastCompressor
from hvps.compression import NoneCompressor as _CoreNone
from hvps.core.flat_shards import FlatLayout

from .compression import as_gradient_compression
from .gradients import variable_name
from .mpi_ops import Average, Sum, grouped_allgather
from .scatter_ops import grouped_reducescatter

__all__ = ["ShardedOptimizer", "DEFAULT_BUCKET_BYTES"]

#: a bucket's default capacity, as the replicated optimizer's gradient buckets (and torch DDP's)
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


class _Bucket:
    """Variables of one dtype flattened into one padded buffer split evenly over the ranks.

    ``slices[i]`` is ``(start, numel)`` of ``variables[i]`` in the flat buffer; ``pieces`` are the parts of
    this rank's block: ``(variable, offset in the variable, length)`` in shard order; ``padding`` is how many
    zeros end this rank's block. ``shard`` is the flat ``keras.Variable`` the inner optimizer steps.
    """

    def __init__(self, index: int, variables: list, size: int, rank: int) -> None:
        self.index, self.variables = index, variables
        self.dtype = variables[0].dtype
        layout = FlatLayout(tuple(int(np.prod(v.shape)) for v in variables), size)
        self.slices, self.numel, self.shard_numel, self.padded = (layout.slices, layout.numel, layout.shard_numel,
                                                                  layout.padded)
        # (variable, offset in it, length), in block order: the pieces fill the block from its start
        self.pieces = [(variables[i], offset, n) for i, offset, _, n in layout.pieces(rank)]
        self.padding = self.shard_numel - sum(n for _, _, n in self.pieces)
        self.shard = keras.Variable(initializer="zeros", shape=(self.shard_numel,), dtype=self.dtype,
                                    trainable=True, name=f"hvps_shard_{index}")

    def flat_gradient(self, grads: list) -> tf.Tensor:
        """The bucket's gradients (``grads[i]`` for ``variables[i]``) as one flat padded tensor."""
        parts = [tf.reshape(tf.cast(g, self.dtype), [-1]) for g in grads]
        if self.padded > self.numel:
            parts.append(tf.zeros([self.padded - self.numel], dtype=self.dtype))
        return tf.concat(parts, 0) if len(parts) > 1 else parts[0]

    def read_variables(self) -> None:
        """Copy this rank's block of the current variable values into ``shard``."""
        parts = [tf.reshape(tf.convert_to_tensor(v), [-1])[offset : offset + n] for v, offset, n in self.pieces]
        if self.padding:
            parts.append(tf.zeros([self.padding], dtype=self.dtype))
        self.shard.assign(tf.concat(parts, 0) if len(parts) > 1 else parts[0])

    def write_variables(self, flat: tf.Tensor) -> None:
        """Install the gathered flat values (every rank's block) into the variables."""
        for v, (start, n) in zip(self.variables, self.slices):
            v.assign(tf.reshape(flat[start : start + n], v.shape))


class ShardedOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras 3 optimizer so that gradients are reduce-scattered and each rank steps 1/N of the state.

    See the module's docstring for the step, the layout and what is supported.
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer, name: Optional[str] = None, compression: Any = None,
                 op: Any = Average, gradient_predivide_factor: float = 1.0, sparse_as_dense: bool = False,
                 backward_passes_per_step: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES, num_groups: int = 0,
                 groups: Any = None, process_set: Any = global_process_set) -> None:
        """Check the combination and build the inner optimizer (the buckets are laid out at ``build``).

        Args:
            optimizer: a Keras 3 optimizer, not built yet (no state).
            name: this optimizer's name (default ``Sharded<class>``).
            compression: ``hvd.Compression.none`` (default), ``.fp16`` or ``.bf16``.
            op: ``hvd.Average`` (default) or ``hvd.Sum``.
            gradient_predivide_factor: Horovod's predivide factor (Average only).
            sparse_as_dense: densify ``tf.IndexedSlices`` gradients instead of refusing them.
            backward_passes_per_step: must be 1 (use the optimizer's ``gradient_accumulation_steps``).
            bucket_bytes: largest bucket in bytes (a larger variable gets a bucket of its own).
            num_groups: ``DistributedOptimizer``'s argument, refused: buckets replace groups.
            groups: ``DistributedOptimizer``'s argument, refused: buckets replace groups.
            process_set: the ranks that share the model; this rank must belong to it.

        Raises:
            TypeError: ``optimizer`` is not a Keras 3 optimizer.
            ValueError: an unsupported combination (see the module's docstring) or bad arguments.
            HvpsError: hvps is not initialized.
        """
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"ShardedOptimizer wraps a Keras 3 keras.optimizers.Optimizer, not {type(optimizer)}")
        _refuse_unsupported(optimizer, op, backward_passes_per_step, num_groups, groups, bucket_bytes)
        op, pipeline, prescale, postscale = options.gradient_options(
            op, gradient_predivide_factor, compression, as_gradient_compression, ops=(Average, Sum))
        if not isinstance(pipeline.compressor, (_CoreNone, CastCompressor)):
            raise ValueError(f"compression {pipeline!r} with a sharded optimizer is not supported: only none, fp16 "
                             "and bf16 (casts that a reduce-scatter can sum)")
        hvps.size()  # HvpsError before hvps.init()
        if not process_set.included():
            raise ValueError("this rank is not in the sharded optimizer's process_set")
        super().__init__(learning_rate=0.0, name=name or f"Sharded{type(optimizer).__name__}")
        self.inner_optimizer = type(optimizer).from_config(optimizer.get_config())
        self.compression, self.op = pipeline, op
        self._prescale, self._postscale = prescale, postscale
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.bucket_bytes = int(bucket_bytes)
        self.process_set = process_set
        self._size, self._rank = process_set.size(), process_set.rank()
        self._buckets: list = []
        self._position: dict = {}
        #: how many times :meth:`relayout` laid the buckets out anew (elastic re-sharding): a step traced before
        #: then holds the old shard variables (``model.fit``'s is dropped by the elastic Keras state)
        self.layout_generation = 0

    # -- layout ------------------------------------------------------------------------------
    def build(self, var_list: Any) -> None:
        """Lay out the buckets over ``var_list``, check the layout across ranks and build the inner optimizer.

        Raises:
            HvpsError: the variables differ across ranks (count, shape or dtype).
        """
        self.build_locally(var_list, check=True)

    def build_locally(self, var_list: Any, check: bool = False) -> None:
        """:meth:`build`, by default without its cross-rank check (a collective): for a worker that joins an
        elastic job, whose sync compares the layouts itself.

        Args:
            var_list: the trainable variables, in the order every rank gives them.
            check: also check the variables across ranks (what :meth:`build` does).

        Raises:
            ValueError: ``var_list`` is empty.
            HvpsError: ``check`` and the variables differ across ranks (count, shape or dtype).
        """
        if self.built:
            return
        var_list = list(var_list)
        if not var_list:
            raise ValueError("the sharded optimizer has no trainable variable to shard")
        if check:
            self._check_same_variables_everywhere(var_list)
        self._position = {_key(v): i for i, v in enumerate(var_list)}
        buckets, current, nbytes = [], [], 0
        for v in var_list:
            size = int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
            if current and (v.dtype != current[0].dtype or nbytes + size > self.bucket_bytes):
                buckets.append(current)
                current, nbytes = [], 0
            current.append(v)
            nbytes += size
        buckets.append(current)
        with keras.name_scope(self.name, caller=self):
            self._buckets = [_Bucket(i, vs, self._size, self._rank) for i, vs in enumerate(buckets)]
        self.inner_optimizer.build([b.shard for b in self._buckets])
        super().build(var_list)

    def _check_same_variables_everywhere(self, var_list: list) -> None:
        """One allgather of (shape, dtype, name) per variable; HvpsError naming the first difference. Names are
        reported, not compared: Keras numbers layers per process, so they may differ between ranks."""
        mine = [Signature(variable_name(v, f"variable{i}"), tuple(int(d) for d in v.shape), str(v.dtype))
                for i, v in enumerate(var_list)]
        check_same_everywhere(mine, "keras_shard.signature", "ShardedOptimizer", "variable",
                              "every rank must build the same model", self.process_set, compare_names=False)

    # -- the wrapped optimizer's face ----------------------------------------------------------
    @property
    def variables(self) -> list:
        """The variables that are the same on every rank (the step count, the learning rate): what
        ``BroadcastGlobalVariablesCallback`` and Keras's own checkpoints see. The
        state that differs per rank is :attr:`shard_state_variables`, kept out so that no broadcast from a
        root overwrites the other ranks' shards."""
        replicated = {id(v) for v in self._replicated_inner_variables()}
        return self._variables + [v for v in self.inner_optimizer.variables if id(v) in replicated]

    @property
    def shard_state_variables(self) -> list:
        """This rank's shard of the optimizer state (momentum, Adam's moments, ...): the inner optimizer's
        variables other than its step count and learning rate."""
        replicated = {id(v) for v in self._replicated_inner_variables()}
        return [v for v in self.inner_optimizer.variables if id(v) not in replicated]

    def _replicated_inner_variables(self) -> list:
        inner = self.inner_optimizer
        rate = getattr(inner, "_learning_rate", None)
        return [inner.iterations] + ([rate] if isinstance(rate, keras.Variable) else [])

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> Any:
        return self.inner_optimizer.iterations

    def scale_loss(self, loss: Any) -> Any:
        return self.inner_optimizer.scale_loss(loss)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError("hvps's Keras ShardedOptimizer runs on the TensorFlow backend (stateful apply)")

    @property
    def shard_variables(self) -> list:
        """This rank's flat shard of each bucket (the variables the inner optimizer steps)."""
        return [b.shard for b in self._buckets]

    def world(self) -> tuple:
        """The world the buckets are laid out for.

        Returns:
            ``(size, rank)``: its number of ranks and this rank in it.
        """
        return self._size, self._rank

    def relayout(self, size: int, rank: int) -> None:
        """Lay the buckets out for a world of ``size`` ranks in which this one is ``rank`` (elastic re-sharding;
        local). The inner optimizer is built afresh over the new shards, keeping its step count and learning
        rate; its shard state starts at zero: install it with :meth:`load_shard_state`.

        Args:
            size: the new number of ranks.
            rank: this rank in the new world.
        """
        if (size, rank) == (self._size, self._rank) or not self.built:
            self._size, self._rank = size, rank
            return
        kept = [np.array(v.numpy()) for v in self._replicated_inner_variables()]
        self._size, self._rank = size, rank
        self.layout_generation += 1
        with keras.name_scope(self.name, caller=self):
            self._buckets = [_Bucket(b.index, b.variables, size, rank) for b in self._buckets]
        self.inner_optimizer = type(self.inner_optimizer).from_config(self.inner_optimizer.get_config())
        self.inner_optimizer.build(self.shard_variables)
        for variable, value in zip(self._replicated_inner_variables(), kept):
            variable.assign(value)

    def shard_state(self) -> list:
        """This rank's shard of the optimizer state, copied to host memory.

        Returns:
            Per bucket, ``{key: 1-D numpy array of the bucket's shard elements}``: the inner optimizer's state
            for that shard (``"momentum"``, ``"velocity"``, ...), keyed by the name Keras gave it after the
            shard's.

        Raises:
            HvpsError: a state variable belongs to no shard (an optimizer that names its state otherwise).
        """
        return [{key: np.array(v.numpy()) for key, v in entry.items()} for entry in self._state_by_bucket()]

    def load_shard_state(self, state: list) -> None:
        """Install this rank's shard of the optimizer state (no communication).

        Args:
            state: :meth:`shard_state`'s form, for this optimizer's buckets in the current layout.

        Raises:
            HvpsError: the buckets or keys differ from the optimizer's.
        """
        mine = self._state_by_bucket()
        if [sorted(entry) for entry in state] != [sorted(entry) for entry in mine]:
            raise HvpsError(f"the shard state has keys {[sorted(e) for e in state]}, the optimizer "
                            f"{[sorted(e) for e in mine]}")
        for entry, values in zip(mine, state):
            for key, variable in entry.items():
                variable.assign(np.asarray(values[key]).reshape(variable.shape))

    def _state_by_bucket(self) -> list:
        """Per bucket, ``{key: state variable}`` of :attr:`shard_state_variables` (Keras names a variable's state
        ``<its path with _ for />_<key>``)."""
        entries: list = [{} for _ in self._buckets]
        prefixes = [bucket.shard.path.replace("/", "_") + "_" for bucket in self._buckets]
        for variable in self.shard_state_variables:
            found = [b for b, prefix in enumerate(prefixes) if variable.name.startswith(prefix)]
            if len(found) != 1 or tuple(variable.shape) != (self._buckets[found[0]].shard_numel,):
                raise HvpsError(f"cannot tell which shard the optimizer state {variable.name!r} (shape "
                                f"{tuple(variable.shape)}) belongs to: Keras names a shard's state after the shard")
            entries[found[0]][variable.name[len(prefixes[found[0]]):]] = variable
        return entries

    def shard_layout(self) -> dict:
        """How the variables lie in the buckets and the buckets over the ranks (JSON-able), as the torch
        ``ShardedOptimizer.shard_layout`` says it: what a sharded checkpoint records.

        Returns:
            ``{"world_size": N, "params": [[name, shape, dtype, True], ...], "buckets": [{"group": 0, "numel": L,
            "shard_numel": s, "params": [[variable index, start, numel], ...]}, ...]}``; variables are numbered
            in the order the optimizer was built with.

        Raises:
            ValueError: the optimizer is not built yet.
        """
        if not self.built:
            raise ValueError("the sharded optimizer has no layout before it is built")
        params = [[variable_name(v, f"variable{i}"), [int(d) for d in v.shape], str(v.dtype), True]
                  for i, v in enumerate(self._trainable_variables)]
        return {"world_size": self._size, "params": params,
                "buckets": [{"group": 0, "numel": b.numel, "shard_numel": b.shard_numel,
                             "params": [[self._position[_key(v)], start, n] for v, (start, n) in
                                        zip(b.variables, b.slices)]} for b in self._buckets]}

    # -- the step -----------------------------------------------------------------------------------
    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        """Reduce-scatter ``grads``, step this rank's shards, all-gather the updated variables.

        Args:
            grads: one gradient (tensor, ``tf.IndexedSlices`` or None) per variable.
            trainable_variables: the variables (the ones the optimizer was built with, in any order);
                needed on the first call unless built.

        Raises:
            ValueError: a sparse gradient without ``sparse_as_dense``, or a variable not built with.
        """
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError("pass trainable_variables on the first call, or build the optimizer first")
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        by_position: list = [None] * len(self._position)
        for g, v in zip(grads, trainable_variables):
            position = self._position.get(_key(v))
            if position is None:
                raise ValueError(f"variable {variable_name(v)!r} is not one the sharded optimizer was built with")
            by_position[position] = self._dense(g, v)
        flats = []
        for bucket in self._buckets:
            first = self._position[_key(bucket.variables[0])]
            flats.append(bucket.flat_gradient(
                [g if g is not None else tf.zeros(v.shape, dtype=v.dtype)
                 for g, v in zip(by_position[first : first + len(bucket.variables)], bucket.variables)]))
        if not tf.executing_eagerly():
            flats = self._behind_layout_check(flats)
        shards = grouped_reducescatter(flats, compression=self.compression, op=self.op,
                                       process_set=self.process_set, prescale_factor=self._prescale,
                                       postscale_factor=self._postscale)
        for bucket in self._buckets:
            bucket.read_variables()
        shard_grads = [tf.reshape(tf.cast(s, b.dtype), [b.shard_numel]) for s, b in zip(shards, self._buckets)]
        self.inner_optimizer.apply(shard_grads, self.shard_variables)
        gathered = grouped_allgather([tf.convert_to_tensor(b.shard) for b in self._buckets],
                                     process_set=self.process_set)
        for bucket, flat in zip(self._buckets, gathered):
            bucket.write_variables(flat)

    def _behind_layout_check(self, tensors: list) -> list:
        """``tensors``, in a step being traced, behind a check that runs with every step: the buckets are still
        laid out as they were when the step was traced. Past an elastic re-sharding the traced step would step
        the old shard variables (or fail reshaping a shard of the new size): it fails naming the cause instead,
        with no collective started. A ``RuntimeError``, not an ``HvpsError``: the elastic loop must not retry
        it, since the same traced step would fail again."""
        traced, world = self.layout_generation, self.world()

        def check() -> np.int64:
            if self.layout_generation != traced:
                raise RuntimeError(
                    f"hvps: this training step was traced (tf.function) while the sharded optimizer's buckets were "
                    f"laid out for {world[0]} ranks; an elastic reset has re-sharded them for {self._size} since, "
                    "and the traced step still holds the old shards. Trace the step again after a reset: "
                    "model.fit does (hvd.elastic.KerasState drops its compiled step); a tf.function of your own "
                    "must be created inside the function that hvd.elastic.run wraps")
            return np.int64(traced)

        checked = tf.numpy_function(check, [], tf.int64, stateful=True, name="hvps_sharded_layout_check")
        with tf.control_dependencies([checked]):
            return [tf.identity(t) for t in tensors]

    def _dense(self, grad: Any, variable: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise ValueError(f"variable {variable_name(variable)!r} has a sparse gradient (tf.IndexedSlices): a "
                                 "sharded optimizer reduce-scatters dense buckets; pass sparse_as_dense=True")
            return tf.convert_to_tensor(grad)
        return grad

    def reset_step(self) -> None:
        """Nothing to forget between steps: a step's collectives are started and finished inside ``apply``."""

    # -- serialisation ----------------------------------------------------------------------------
    def get_config(self) -> dict:
        return {"name": self.name, "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "compression": self.compression.name, "op": self.op.name,
                "gradient_predivide_factor": self.gradient_predivide_factor,
                "sparse_as_dense": self.sparse_as_dense, "bucket_bytes": self.bucket_bytes}

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> "ShardedOptimizer":
        from hvps.compression.framework_compressors import from_name

        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        config["compression"] = from_name(config.get("compression", "none"))
        config["op"] = getattr(hvps.ReduceOp, config.get("op", "Average"))
        return cls(inner, **config)


def _refuse_unsupported(optimizer: keras.optimizers.Optimizer, op: Any, backward_passes_per_step: int,
                        num_groups: int, groups: Any, bucket_bytes: int) -> None:
    """ValueError naming the first combination a sharded optimizer cannot run."""
    kind = type(optimizer).__name__
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError("LossScaleOptimizer with a sharded optimizer is not supported: its finite-gradient check "
                         "would see one shard per rank and could skip the step on some ranks only")
    if hasattr(optimizer, "inner_optimizer"):  # hvps's DistributedOptimizer or ShardedOptimizer, or another wrapper
        raise ValueError(f"the optimizer is already a wrapper ({kind}): wrap the plain Keras optimizer")
    sharded_op(op, "a sharded optimizer")
    if int(backward_passes_per_step) != 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step} with a sharded optimizer is not "
                         "supported: give the optimizer gradient_accumulation_steps instead (it accumulates the "
                         "averaged gradient shards)")
    if num_groups or groups is not None:
        raise ValueError("groups/num_groups with a sharded optimizer is not supported: gradients travel in buckets "
                         "(bucket_bytes)")
    if int(bucket_bytes) <= 0:
        raise ValueError("bucket_bytes must be positive")
    if optimizer.built:
        raise ValueError(f"the {kind} is already built (it has state): wrap it before its first step")
    for attribute in ("clipnorm", "global_clipnorm"):
        if getattr(optimizer, attribute, None):
            raise ValueError(f"{attribute} with a sharded optimizer is not supported: the norm spans whole "
                             "variables, a rank sees one shard (clipvalue works)")
    if getattr(optimizer, "use_ema", False):
        raise ValueError("use_ema with a sharded optimizer is not supported: the moving average would be of the "
                         "shards, not of the model's variables")
    if getattr(optimizer, "_exclude_from_weight_decay", None) or \
            getattr(optimizer, "_exclude_from_weight_decay_pattern", None) is not None:
        raise ValueError("exclude_from_weight_decay with a sharded optimizer is not supported: a bucket mixes "
                         "variables, its shard has one weight decay")


def _key(variable: Any) -> int:
    return id(variable)
