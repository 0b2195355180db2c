"""Property-based tests (hypothesis) of what strangers and files can feed hvps: the
control plane's parser and handshake, the checkpoint manifest schema, and the
negotiation coordinator's agreement."""

import json
import secrets

import pytest
from hypothesis import HealthCheck, given, settings
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


@SETTINGS
@given(st.lists(datasets, min_size=1, max_size=3), st.sampled_from(["format_version", "root", "datasets", "groups"]),
       json_values)
def test_any_structural_edit_is_a_defect_or_valid(ds, field, value):
    manifest = _manifest(ds, 1, 2)
    manifest[field] = value
    try:
        check_manifest(manifest, 1)
    except Defect:
        return


@SETTINGS
@given(st.lists(datasets, min_size=1, max_size=3), st.sampled_from(["path", "dtype", "storage", "shape", "nbytes",
                                                                   "sha256"]), json_values)
def test_any_dataset_edit_is_a_defect_or_valid(ds, field, value):
    manifest = _manifest(ds, 1, 2)
    manifest["datasets"][0][field] = value
    try:
        check_manifest(manifest, 1)
    except Defect:
        return


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
