"""A stage 1-2 sharded optimizer's state as per-rank shards plus a manifest, in numpy (no framework).

What the torch and Keras sharded optimizer checkpoints share (``hvps.adapters.torch.sharded_checkpoint``,
``hvps.adapters.tensorflow.keras.sharded_checkpoint``): the shard files (``optim-epoch-N/optimizer.<rank>-of-
<size>.h5``, one ``/optimizer/bNNNNN/<key>`` dataset per bucket and element-wise state, written by
:mod:`hvps.checkpoint.sharded_buffers`), the manifest that the dense checkpoint of the version records as its
``optimizer/sharded`` section (its schema, checked as untrusted input by :func:`check_manifest`), and the reads:
one rank's new block of every bucket of a layout at any rank count (:func:`stage_sharded`, reading only the saved
ranges it needs) or the whole state per parameter (:func:`stage_consolidated`, for an unsharded optimizer). The
adapters turn their optimizers' state into numpy arrays and scalars before, and back after.

A *layout* is ``{"world_size": N, "params": [[name, shape, dtype, requires_grad], ...], "buckets": [{"group": g,
"numel": L, "shard_numel": s, "params": [[parameter index, start, numel], ...]}, ...]}``, as a sharded
optimizer's ``shard_layout()`` returns it. A bucket's state is ``{key: value}``: element-wise state a 1-D array
of the bucket's ``shard_numel`` elements, anything else a scalar encoded as :func:`~hvps.checkpoint.
sharded_buffers.scalar_ok` describes.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Mapping, Optional

import numpy as np

from .. import api
from .format import CheckpointError, logical_dtype, root_attributes
from .resharding import param_pieces, shard_bounds, shard_numel
from .safety import is_int, need
from .sharded_buffers import (STATE_KEY, SavedShards, check_flat_buffer, check_manifest_head, check_params,
                              check_shard_list, checked_manifest, params_fingerprint, save_rank_shards, scalar_ok,
                              write_rank_shard)
from .sharded_buffers import shard_file_name as _file_name
from .shards import shard_folder, short, tidy_shard_folders

FORMAT = "hvps-sharded-optimizer"
FORMAT_VERSION = 1
PREFIX = "optim"
FOLDER_RE = re.compile(r"^optim-epoch-(\d{6,})$")
STEM = "optimizer"  # the shards' file names
SECTION = "sharded"  # the manifest's key in the dense file's optimizer section

__all__ = ["FORMAT", "FORMAT_VERSION", "PREFIX", "SECTION", "shard_file_name", "is_sharded_manifest", "save_shards",
           "tidy", "check_manifest", "manifest_of", "misfit_params", "open_shards", "relayout", "stage_sharded",
           "stage_consolidated", "read_parameter_state", "parameter_locations"]


def shard_file_name(rank: int, size: int) -> str:
    """The file name of ``rank``'s shard when ``size`` ranks saved."""
    return _file_name(STEM, rank, size)


def _bucket_key(b: int) -> str:
    return f"b{int(b):05d}"


def _dataset(b: int, key: str) -> str:
    return f"/optimizer/{_bucket_key(b)}/{key}"


def is_sharded_manifest(optimizer_section: Any) -> bool:
    """Whether a loaded checkpoint's ``optimizer`` section is a sharded optimizer's manifest."""
    return isinstance(optimizer_section, Mapping) and SECTION in optimizer_section


# ----------------------------------------------------------------------------- saving
def save_shards(manager: Any, epoch: int, step: Optional[int], process_set: Any, layout: dict, arrays: dict,
                head: dict, framework: tuple) -> dict:
    """Write every rank's shard of a sharded optimizer's state for version ``epoch`` (collective over the job);
    the section to save as the dense checkpoint's ``optimizer``.

    Args:
        manager: the ``CheckpointManager`` (its ``directory`` and ``fsync``).
        epoch: the version being saved.
        step: the step recorded in the shards' root attributes.
        process_set: the optimizer's process set (its ``size()`` and ``rank()``); it must hold every rank.
        layout: the optimizer's layout (see the module's docstring).
        arrays: this rank's element-wise state, ``{bucket index: {key: 1-D array of shard_numel elements}}``.
        head: the manifest's ``class``, ``param_groups`` and ``buckets`` (the layout's buckets with their
            ``keys``, key -> dtype, and ``scalars``).
        framework: ``(name, version)`` written as the shards' root attributes (a loader expects the name).

    Returns:
        ``{"sharded": manifest}``, JSON-able (the same on every rank).

    Raises:
        CheckpointError: on every rank, when a rank could not write its shard (earlier versions stay intact),
            or the process set is not the whole job.
    """
    size = process_set.size()
    job = api.size() if api.is_initialized() else 1
    if size != job:
        raise CheckpointError(f"a sharded optimizer over {size} of the job's {job} ranks cannot be checkpointed: "
                              "its process set must hold every rank")
    fingerprint = params_fingerprint(layout["params"])
    folder = shard_folder(manager.directory, PREFIX, epoch)
    rank = process_set.rank()

    def write() -> str:
        folder.mkdir(parents=True, exist_ok=True)
        datasets = {}
        for b, entry in arrays.items():
            for key, array in entry.items():
                if not STATE_KEY.match(key):
                    raise CheckpointError(f"optimizer state {short(key)} cannot name a dataset (letters, digits, _)")
                datasets[_dataset(b, key)] = (array, f"{_bucket_key(b)}.{key}")
        extra = {"rank": rank, "world_size": size, "fingerprint": fingerprint}
        attrs = root_attributes(epoch, step, size, *framework)
        return write_rank_shard(folder / shard_file_name(rank, size), datasets, extra, attrs,
                                getattr(manager, "fsync", True))

    digests = save_rank_shards(write, rank, size, f"the sharded optimizer state of epoch {epoch}", folder,
                               f"ckpt.save.optim.{int(epoch)}")
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "class": head["class"], "world_size": size,
                "fingerprint": fingerprint, "params": layout["params"], "param_groups": head["param_groups"],
                "buckets": head["buckets"],
                "shards": [{"file": shard_file_name(r, size), "rank": r, "sha256": d} for r, d in enumerate(digests)]}
    return {SECTION: manifest}


def tidy(manager: Any, epoch: int) -> None:
    """After committing ``epoch`` (root only): drop the shard folders of versions retention removed."""
    tidy_shard_folders(manager, epoch, FOLDER_RE)


# ----------------------------------------------------------------------------- the manifest
def check_manifest(manifest: Any) -> None:
    """Raise Defect unless ``manifest`` has the structure, types, ranges and consistency that
    :func:`save_shards` writes."""
    check_manifest_head(manifest, {"format", "format_version", "class", "world_size", "fingerprint", "params",
                                   "param_groups", "buckets", "shards"}, FORMAT, FORMAT_VERSION)
    need(isinstance(manifest["class"], str), "class", "must be a string")
    size, params = manifest["world_size"], manifest["params"]
    check_params(params, manifest["fingerprint"])
    groups = manifest["param_groups"]
    need(isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups),
         "param_groups", "must be a list of objects with params")
    need([i for g in groups for i in g["params"]] == list(range(len(params))), "param_groups",
         "must number the parameters 0, 1, ... in order")
    group_of = {i: gi for gi, g in enumerate(groups) for i in g["params"]}
    seen: set = set()
    for b, bucket in enumerate(manifest["buckets"] if isinstance(manifest["buckets"], list) else [None]):
        at = f"buckets[{b}]"
        need(isinstance(bucket, dict) and set(bucket) == {"group", "numel", "shard_numel", "params", "keys",
                                                           "scalars"}, at, "must be a bucket object")
        need(is_int(bucket["group"]) and 0 <= bucket["group"] < len(groups), f"{at}.group", "out of range")
        check_flat_buffer(bucket, at, size, params, seen)
        need(bucket["numel"] >= 1, f"{at}.numel", "must be a positive integer")
        need(all(group_of[index] == bucket["group"] for index, _, _ in bucket["params"]), f"{at}.params",
             "holds a parameter of another group")
        keys = bucket["keys"]
        scalars = bucket["scalars"]
        need(isinstance(scalars, dict) and all(isinstance(k, str) and STATE_KEY.match(k) and k not in keys and scalar_ok(v)
                                               for k, v in scalars.items()), f"{at}.scalars", "must map names to scalars")
    need(seen == {i for i, p in enumerate(params) if p[3]}, "buckets", "must hold every trainable parameter once")
    check_shard_list(manifest["shards"], size, STEM)


def manifest_of(section: Mapping, path: Any) -> dict:
    """The checked manifest of a loaded ``optimizer`` section.

    Raises:
        CheckpointError: the manifest is malformed (a defect of the version).
    """
    return checked_manifest(section.get(SECTION), check_manifest, "sharded optimizer", path)


def misfit_params(saved: list, mine: list, same_names: Callable[[Any, Any], bool]) -> list:
    """The first difference between a manifest's parameters and an optimizer's, as a problem (or none).

    Args:
        saved: the manifest's ``[name, shape, dtype, requires_grad]`` list.
        mine: the optimizer's, alike.
        same_names: whether two names are to be compared (both given and meaningful).

    Returns:
        At most one problem per list (another model).
    """
    if len(saved) != len(mine):
        return [f"the checkpoint is of a model with {len(saved)} parameters, the optimizer has {len(mine)} (a "
                "checkpoint of another model)"]
    for i, (a, b) in enumerate(zip(saved, mine)):
        named = same_names(a[0], b[0])
        if (a if named else a[1:]) != (b if named else b[1:]):
            return [f"parameter {i}: checkpoint has {short(a[0])} {a[1]} {a[2]}{'' if a[3] else ' (frozen)'}, "
                    f"the optimizer {b[0] or ''} {b[1]} {b[2]}{'' if b[3] else ' (frozen)'} (a checkpoint of "
                    "another model)"]
    return []


# ----------------------------------------------------------------------------- reading
def open_shards(directory: os.PathLike, manifest: dict, epoch: int, framework: str) -> SavedShards:
    """The saved shards of version ``epoch``, to be checked against ``manifest`` as they are opened.

    Args:
        directory: the checkpoint directory.
        manifest: the checked manifest.
        epoch: the version.
        framework: what the shards' root attribute ``framework`` must say.
    """
    expected = {_dataset(b, k): (dtype, bucket["shard_numel"], f"{_bucket_key(b)}.{k}")
                for b, bucket in enumerate(manifest["buckets"]) for k, dtype in bucket["keys"].items()}
    identity = {"framework": framework, "epoch": epoch, "world_size": manifest["world_size"],
                "fingerprint": manifest["fingerprint"]}
    return SavedShards(shard_folder(directory, PREFIX, epoch), manifest["shards"], identity, expected)


def relayout(layout: dict, size: int) -> dict:
    """``layout`` as the same buckets split over ``size`` ranks.

    Args:
        layout: the layout at its own world size.
        size: another world size.

    Returns:
        The layout a sharded optimizer with the same buckets would have at ``size`` ranks.
    """
    return dict(layout, world_size=size,
                buckets=[dict(b, shard_numel=shard_numel(b["numel"], size)) for b in layout["buckets"]])


def parameter_locations(manifest: dict) -> dict:
    """Where each trainable parameter's element-wise state lies in the saved buckets.

    Args:
        manifest: a checked manifest.

    Returns:
        Parameter index (in the manifest) -> ``(saved bucket, its first element in that bucket)``.
    """
    return {index: (b, start) for b, bucket in enumerate(manifest["buckets"]) for index, start, _ in bucket["params"]}


def _empty(dtype: str, n: int, where: str) -> np.ndarray:
    return np.zeros(n, dtype=logical_dtype(dtype, where))


def stage_sharded(shards: SavedShards, manifest: dict, layout: dict, rank: int,
                  decode: Callable[[dict], Any]) -> dict:
    """Rank ``rank``'s shard of every bucket of ``layout`` (at any world size), reading only the saved ranges
    it needs.

    Args:
        shards: :func:`open_shards` of the version.
        manifest: its checked manifest.
        layout: the loading optimizer's layout, or one computed for another world size (:func:`relayout`).
        rank: the rank in ``layout``'s world.
        decode: turns a manifest's scalar (``{"value": v}`` or ``{"tensor": dtype, "value": v}``) into a value.

    Returns:
        ``{bucket index: {key: value}}``: element-wise state as 1-D arrays of the bucket's shard length (zero
        padded), scalars decoded; buckets without state are left out.

    Raises:
        CheckpointError: the parameters of one new bucket were saved with different state, or a shard read fails.
    """
    where = parameter_locations(manifest)
    staged: dict = {}
    for nb, bucket in enumerate(layout["buckets"]):
        sources = sorted({where[index][0] for index, _, _ in bucket["params"]})
        keys = [manifest["buckets"][b]["keys"] for b in sources]
        scalars = [manifest["buckets"][b]["scalars"] for b in sources]
        if any(k != keys[0] for k in keys) or any(s != scalars[0] for s in scalars):
            raise CheckpointError(f"the parameters of bucket {nb} were saved with different state (keys "
                                  f"{short(keys)}, scalars {short(scalars)}): a sharded optimizer keeps one per bucket")
        if not keys[0] and not scalars[0]:
            continue
        lo, hi = shard_bounds(bucket["numel"], layout["world_size"], rank)
        entry = {k: decode(v) for k, v in scalars[0].items()}
        for key, dtype in keys[0].items():
            flat = _empty(dtype, hi - lo, key)
            for index, p_offset, s_offset, n in param_pieces(bucket["params"], lo, hi):
                b, start = where[index]
                shards.read_flat(_dataset(b, key), manifest["buckets"][b]["numel"], start + p_offset, n,
                                 flat[s_offset:s_offset + n])
            entry[key] = flat
        staged[nb] = entry
    return staged


def stage_consolidated(shards: SavedShards, manifest: dict, decode: Callable[[dict], Any]) -> dict:
    """The whole state, per parameter (for an unsharded optimizer): every shard that holds part of it is read.

    Args:
        shards: :func:`open_shards` of the version.
        manifest: its checked manifest.
        decode: as :func:`stage_sharded`'s.

    Returns:
        ``{parameter index: {key: value}}``: element-wise state as arrays of the parameter's shape, scalars
        decoded; parameters without state are left out.
    """
    state: dict = {}
    for b, bucket in enumerate(manifest["buckets"]):
        for index, start, n in bucket["params"]:
            shape = manifest["params"][index][1]
            entry = {key: decode(value) for key, value in bucket["scalars"].items()}
            for key, dtype in bucket["keys"].items():
                flat = _empty(dtype, n, key)
                shards.read_flat(_dataset(b, key), bucket["numel"], start, n, flat)
                entry[key] = flat.reshape(shape)
            if entry:
                state[index] = entry
    return state



def read_parameter_state(shards: SavedShards, manifest: dict, location: tuple, key: str, offset: int,
                         out: np.ndarray) -> None:
    """Elements ``[offset, offset + out.size)`` of one parameter's element-wise state ``key`` (for a target
    that holds its own slice of each parameter, such as a fully sharded model's optimizer).

    Args:
        shards: :func:`open_shards` of the version.
        manifest: its checked manifest.
        location: the parameter's ``(saved bucket, first element)``, from :func:`parameter_locations` (computed
            once per load: a trainable parameter's; its bucket must hold ``key``).
        key: the state's name.
        offset: the first element wanted, in the parameter's flattened elements.
        out: a 1-D array of the key's dtype, filled in place.
    """
    b, start = location
    shards.read_flat(_dataset(b, key), manifest["buckets"][b]["numel"], start + offset, out.size, out)
