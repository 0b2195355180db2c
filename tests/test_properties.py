"""Property-based tests (hypothesis) of what strangers and files can feed hvps: the
control plane's parser and handshake, the checkpoint manifest schema, and the
negotiation coordinator's agreement."""

import json
import math
import re
import secrets

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hvps.checkpoint.safety import Defect, check_manifest
from hvps.control.handshake import ServerHandshake
from hvps.control.negotiation import ALLREDUCE, Coordinator, Request
from hvps.control.wire import MAX_UNAUTHENTICATED, FrameReader, ProtocolError, Session, encode, frame, parse_object

pytestmark = pytest.mark.unit

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                           max_leaves=20)


# ----------------------------------------------------------------------------- control plane
@SETTINGS
@given(st.lists(st.binary(max_size=600), max_size=8))
def test_any_bytes_give_frames_or_protocol_error(chunks):
    reader = FrameReader(MAX_UNAUTHENTICATED)
    try:
        for chunk in chunks:
            for payload in reader.feed(chunk):
                assert len(payload) <= MAX_UNAUTHENTICATED
                parse_object(payload, frozenset({"rank", "nonce"}))
    except ProtocolError:
        pass


@SETTINGS
@given(json_values, st.integers(0, 3000))
def test_parser_refuses_anything_but_known_objects(value, depth):
    data = ("[" * depth).encode() + json.dumps(value).encode() + ("]" * depth).encode()
    try:
        message = parse_object(data, frozenset({"rank", "nonce"}))
    except ProtocolError:
        return
    assert isinstance(message, dict) and set(message) <= {"rank", "nonce"} and message


@SETTINGS
@given(st.dictionaries(st.sampled_from(["requests", "responses"]), json_values, min_size=1),
       st.integers(0, 200), st.integers(0, 255))
def test_session_frames_cannot_be_forged_or_replayed(message, position, flip):
    key = secrets.token_bytes(32)
    sender, receiver = Session(key, b"a", b"b"), Session(key, b"b", b"a")
    sealed = sender.seal(message)[4:]
    assert receiver.open(sealed, frozenset({"requests", "responses"})) == json.loads(encode(message))
    with pytest.raises(ProtocolError):  # the same frame again: its sequence number is spent
        receiver.open(sealed, frozenset({"requests", "responses"}))
    forged = bytearray(sender.seal(message)[4:])
    forged[position % len(forged)] ^= flip or 1
    with pytest.raises(ProtocolError):
        receiver.open(bytes(forged), frozenset({"requests", "responses"}))


@SETTINGS
@given(st.lists(st.binary(max_size=300), max_size=6), st.integers(2, 9))
def test_server_handshake_answers_strangers_with_protocol_error(chunks, size):
    handshake = ServerHandshake(secrets.token_bytes(32), size, taken=set())
    try:
        for chunk in chunks:
            handshake.feed(chunk)
    except ProtocolError:
        return
    assert handshake.session is None  # without the key, never authenticated


@SETTINGS
@given(json_values, st.integers(-5, 20))
def test_server_handshake_checks_rank_range(rank_value, size):
    handshake = ServerHandshake(secrets.token_bytes(32), max(size, 2), taken={1})
    hello = frame(encode({"rank": rank_value, "nonce": secrets.token_hex(16)}))
    try:
        handshake.feed(hello)
    except ProtocolError:
        return
    assert isinstance(rank_value, int) and not isinstance(rank_value, bool) and 1 < rank_value < max(size, 2)


# ----------------------------------------------------------------------------- manifest schema
datasets = st.builds(
    lambda name, dtype, shape: {"path": f"/model/{name}", "dtype": dtype[0], "storage": dtype[1], "shape": shape,
                                "nbytes": dtype[2] * (1 if not shape else __import__("math").prod(shape)),
                                "sha256": "0" * 64},
    st.text("abcxyz._-0123456789", min_size=1, max_size=12),
    st.sampled_from([("float32", "<f4", 4), ("int64", "<i8", 8), ("bool", "|b1", 1), ("bfloat16", "<i2", 2)]),
    st.lists(st.integers(0, 50), max_size=4))


def _manifest(ds, epoch, world):
    unique = {d["path"]: d for d in ds}
    return {"format_version": 1, "root": {"epoch": epoch, "world_size": world, "step": -1},
            "datasets": list(unique.values()), "groups": {"/model": {}}}


@SETTINGS
@given(st.lists(datasets, max_size=5), st.integers(0, 10**6), st.integers(1, 4096))
def test_valid_manifests_pass(ds, epoch, world):
    check_manifest(_manifest(ds, epoch, world), 1)


def _is_int(value) -> bool:
    return type(value) is int  # bool is not an integer in a manifest


def _valid_top_level(field, value) -> bool:
    """Whether ``value`` is a valid ``field`` of a manifest, by the schema hvps writes, for the values
    drawn here: ``json_values``' dicts have at most 4 keys, so a drawn list never holds a dataset
    (6 keys) and the only valid ``datasets`` drawn is ``[]``."""
    if field == "format_version":
        return _is_int(value) and value == 1
    if field == "root":
        return (isinstance(value, dict) and _is_int(value.get("epoch")) and value["epoch"] >= 0
                and _is_int(value.get("world_size")) and value["world_size"] >= 1
                and _is_int(value.get("step", -1)) and value.get("step", -1) >= -1)
    if field == "datasets":
        return value == []
    return isinstance(value, dict) and all(k.startswith("/") and isinstance(v, dict) for k, v in value.items())


def _logical_names(storage: str) -> set:
    """The dtype names a tensor stored as ``storage`` may declare: the storage's own, and, for integer
    storage, ml_dtypes' types of the same width (bfloat16 is stored as int16)."""
    import ml_dtypes
    import numpy as np

    stored = np.dtype(storage)
    names = {stored.name}
    if stored.kind == "i":
        for name in dir(ml_dtypes):
            if name.startswith("_") or not isinstance(getattr(ml_dtypes, name), type):
                continue
            try:
                dtype = np.dtype(getattr(ml_dtypes, name))
            except (TypeError, ValueError):
                continue
            if dtype.kind == "V" and dtype.itemsize == stored.itemsize:
                names.add(name)
    return names


def _valid_dataset_edit(original: dict, others: list, field, value) -> bool:
    """Whether ``original`` (a valid dataset entry) with ``field`` set to ``value`` is still valid beside
    ``others``: a path in a known section and listed once, a dtype the storage may carry, the same
    storage code under any byte-order mark, a shape and nbytes that agree, a digest of 64 hex digits."""
    import numpy as np

    itemsize = np.dtype(original["storage"]).itemsize
    if field == "path":
        return (isinstance(value, str) and len(value) < 4096 and value not in {d["path"] for d in others}
                and re.fullmatch(r"/(model|optimizer|compression|rng|extra)(/[^/]+)+", value) is not None)
    if field == "dtype":
        return isinstance(value, str) and value in _logical_names(original["storage"])
    if field == "storage":
        return isinstance(value, str) and value[:1] in ("<", ">", "|") and value[1:] == original["storage"][1:]
    if field == "shape":
        return (isinstance(value, list) and len(value) <= 32 and all(_is_int(n) and n >= 0 for n in value)
                and math.prod(value) * itemsize == original["nbytes"])
    if field == "nbytes":
        return _is_int(value) and value == original["nbytes"]
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


#: besides any JSON value, values that are valid in some field, so that both outcomes are drawn
TOP_LEVEL_VALUES = json_values | st.sampled_from([1, [], {}, {"/a": {}}, {"epoch": 0, "world_size": 3, "step": -1}])
DATASET_VALUES = json_values | st.sampled_from([">f4", "|b1", "<i2", ">i8", "/model/x", "/optimizer/a/b", "bfloat16",
                                                "int16", "float32", "bool", "0" * 64, "A" * 64, 0, 4, 8, [], [1],
                                                [2, 2]])


@SETTINGS
@given(st.lists(datasets, min_size=1, max_size=3), st.sampled_from(["format_version", "root", "datasets", "groups"]),
       TOP_LEVEL_VALUES)
def test_a_structural_edit_is_a_defect_exactly_when_invalid(ds, field, value):
    """Replacing a top-level field with any JSON value: ``check_manifest`` accepts the manifest when the
    new value is one hvps could have written there and raises Defect otherwise (never another
    exception). It must be both: a checker that raised on every edit would refuse good files after a
    harmless rewrite (``datasets: []``, ``groups: {}``), one that raised on none would let a stranger's
    file reach h5py; ``check_manifest``'s own contract is "raise Defect unless the manifest has the
    structure, types and ranges hvps writes", which is this oracle."""
    manifest = _manifest(ds, 1, 2)
    manifest[field] = value
    if _valid_top_level(field, value):
        check_manifest(manifest, 1)
    else:
        with pytest.raises(Defect):
            check_manifest(manifest, 1)


@SETTINGS
@given(st.lists(datasets, min_size=1, max_size=3), st.sampled_from(["path", "dtype", "storage", "shape", "nbytes",
                                                                   "sha256"]), DATASET_VALUES)
@example([{"path": "/model/w", "dtype": "float32", "storage": "<f4", "shape": [1], "nbytes": 4, "sha256": "0" * 64}],
         "dtype", "__dict__")  # once a bare ValueError from np.dtype(ml_dtypes.__dict__), not a Defect
def test_a_dataset_edit_is_a_defect_exactly_when_invalid(ds, field, value):
    """Replacing one field of a dataset entry with any JSON value: accepted when the entry still
    describes a tensor hvps could have written (see ``_valid_dataset_edit``), Defect otherwise, for
    the same reason as the structural edits: the checker's contract is exact, so the test is too."""
    manifest = _manifest(ds, 1, 2)
    original, others = dict(manifest["datasets"][0]), manifest["datasets"][1:]
    manifest["datasets"][0][field] = value
    if _valid_dataset_edit(original, others, field, value):
        check_manifest(manifest, 1)
    else:
        with pytest.raises(Defect):
            check_manifest(manifest, 1)


# ----------------------------------------------------------------------------- coordinator
@SETTINGS
@given(st.integers(2, 4), st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), min_size=1, max_size=5, unique=True),
       st.randoms(use_true_random=False))
def test_coordinator_releases_each_name_once_in_one_order(size, names, rnd):
    """Whatever order ranks announce the same collectives in, each is released exactly once,
    only after every rank announced it, as one ordered list that every rank executes."""
    coordinator = Coordinator(size, fusion_threshold=0, stall_seconds=60)
    events = [(rank, name) for rank in range(size) for name in names]
    rnd.shuffle(events)
    announced: dict = {}
    released = []
    for now, (rank, name) in enumerate(events):
        coordinator.submit(rank, [Request(name, ALLREDUCE, dtype="float32", shapes=((4,),), op="sum")], float(now))
        announced.setdefault(name, set()).add(rank)
        for response in coordinator.poll(float(now)):
            assert not response.error
            for n in response.names:
                assert announced[n] == set(range(size))  # never early
            released.extend(response.names)
    assert sorted(released) == sorted(names)  # each exactly once
