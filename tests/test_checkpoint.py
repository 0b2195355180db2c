"""Single-process tests of the HDF5 checkpoints (hvps.checkpoint and the torch adapter)."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
import pytest
import torch

import hvps
import hvps.adapters.torch as hvd
from hvps.checkpoint.format import FORMAT_VERSION, CheckpointError, root_attributes, write_file
from hvps.checkpoint.manager import CheckpointManager, file_name

REPO = Path(__file__).resolve().parent.parent


def small_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Flatten(),
                            torch.nn.Linear(8 * 6 * 6, 10))
    return m.to(dtype)


def train_steps(model, opt, steps=3, dtype=torch.float32):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 3, 8, 8, dtype=dtype)).float().square().mean().backward()
        opt.step()


def assert_state_dicts_bit_equal(a, b):
    assert list(a) == list(b)
    for k in a:
        x, y = a[k], b[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.view(-1).view(torch.uint8) if x.dtype.is_floating_point else x,
                           y.view(-1).view(torch.uint8) if y.dtype.is_floating_point else y), k


def assert_optimizer_bit_equal(o1, o2):
    s1, s2 = o1.state_dict(), o2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys()
    for i in s1["state"]:
        assert s1["state"][i].keys() == s2["state"][i].keys()
        for k, v in s1["state"][i].items():
            w = s2["state"][i][k]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and v.shape == w.shape, (i, k)
                assert v.view(-1).view(torch.uint8).equal(w.view(-1).view(torch.uint8)), (i, k)
            else:
                assert v == w


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adam"])
def test_torch_round_trip_bit_exact(tmp_path, dtype, opt_name):
    model = small_model(dtype)
    make = {"sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
            "adam": lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.8, 0.95))}[opt_name]
    opt = make(model.parameters())
    train_steps(model, opt, dtype=dtype)
    mgr = hvd.CheckpointManager(tmp_path)
    path = mgr.save(4, model=model, optimizer=opt, step=123, extra={"best": 0.5, "hist": torch.arange(5)})
    assert path == tmp_path / "ckpt-epoch-000004.h5"

    model2 = small_model(dtype, seed=1)
    opt2 = make(model2.parameters())
    assert mgr.load(model=model2, optimizer=opt2) == 5  # the saved epoch + 1
    assert_state_dicts_bit_equal(model.state_dict(), model2.state_dict())
    assert_optimizer_bit_equal(opt, opt2)
    assert mgr.loaded.epoch == 4 and mgr.loaded.step == 123
    assert mgr.loaded.extra["best"] == 0.5
    np.testing.assert_array_equal(mgr.loaded.extra["hist"], np.arange(5))
    # Training continues identically from both.
    torch.manual_seed(7)
    train_steps(model, opt, dtype=dtype)
    torch.manual_seed(7)
    train_steps(model2, opt2, dtype=dtype)
    assert_state_dicts_bit_equal(model.state_dict(), model2.state_dict())


def test_bfloat16_stored_as_int16_with_dtype_attribute(tmp_path):
    model = small_model(torch.bfloat16)
    path = hvd.CheckpointManager(tmp_path).save(0, model=model)
    with h5py.File(path, "r") as f:
        ds = f["model/0.weight"]
        assert ds.dtype == np.int16
        assert ds.attrs["dtype"] == "bfloat16"
        raw = ds[()]
    expected = model.state_dict()["0.weight"].view(torch.int16).numpy()
    np.testing.assert_array_equal(raw, expected)


def test_distributed_optimizer_state_round_trip(tmp_path):
    hvps.init()
    try:
        model = small_model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters())
        train_steps(model, opt)
        mgr = hvd.CheckpointManager(tmp_path)
        mgr.save(2, model=model, optimizer=opt)
        model2 = small_model(seed=3)
        opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.1),
                                        named_parameters=model2.named_parameters())
        assert mgr.load(model=model2, optimizer=opt2) == 3
        assert_optimizer_bit_equal(opt, opt2)
        assert opt2.param_groups[0]["lr"] == 0.1
        with h5py.File(tmp_path / file_name(2)) as f:
            assert json.loads(f["optimizer"].attrs["param_groups"])[0]["momentum"] == 0.9
            assert "momentum_buffer" in f["optimizer/state/0"]
    finally:
        hvps.shutdown()


def test_rng_states_restored(tmp_path):
    mgr = hvd.CheckpointManager(tmp_path)
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    torch.rand(3), np.random.rand(), random.random()
    mgr.save(0, model=small_model())
    expect = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)])
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    mgr.load(model=small_model())
    got = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)])
    assert torch.equal(expect[0], got[0])
    np.testing.assert_array_equal(expect[1], got[1])
    assert expect[2] == got[2]


def test_neutral_round_trip_all_kinds(tmp_path):
    arrays = {
        "f16": np.linspace(-3, 3, 7).astype(np.float16),
        "bf16": np.linspace(-3, 3, 7).astype(ml_dtypes.bfloat16),
        "f64": np.random.default_rng(0).standard_normal((3, 4)),
        "i8": np.arange(-4, 4, dtype=np.int8), "u64": np.arange(3, dtype=np.uint64),
        "bool": np.array([True, False, True]), "c64": np.array([1 + 2j], np.complex64),
        "scalar": np.array(3.5), "empty": np.zeros((0, 3), np.float32),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "name/with/slashes": np.ones(2), "%percent": np.ones(1), ".": np.zeros(1),
    }
    extra = {"cfg": {"lr": 0.1, "layers": [1, 2], "pair": (1, "a"), "none": None, "nan": float("nan")},
             "arr": np.ones(3)}
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, model=arrays, extra=extra, compression_state={"res": np.full(4, 2.0)}, step=9)
    assert mgr.load() == 2
    ck = mgr.loaded
    assert list(ck.model) == list(arrays)
    for k, a in arrays.items():
        b = ck.model[k]
        assert b.dtype == a.dtype and b.shape == a.shape, k
        assert a.tobytes(order="C") == b.tobytes(), k
    assert ck.extra["cfg"]["pair"] == (1, "a") and ck.extra["cfg"]["none"] is None
    assert np.isnan(ck.extra["cfg"]["nan"]) and ck.extra["cfg"]["layers"] == [1, 2]
    np.testing.assert_array_equal(ck.compression_state["res"], np.full(4, 2.0))


def test_no_pickle_and_object_arrays_refused(tmp_path):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match="object arrays"):
        mgr.save(0, model={"x": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(CheckpointError, match="neither as an array nor as JSON"):
        mgr.save(0, extra={"f": lambda: 1})
    assert mgr.list() == []
    assert not any(tmp_path.iterdir()), "a failed save must leave nothing behind"


def test_root_attributes(tmp_path):
    path = hvd.CheckpointManager(tmp_path).save(7, model=small_model(), step=70)
    with h5py.File(path) as f:
        a = dict(f.attrs)
    assert a["format_version"] == FORMAT_VERSION and a["epoch"] == 7 and a["step"] == 70
    assert a["world_size"] == 1 and a["framework"] == "torch" and a["framework_version"] == torch.__version__
    assert a["hvps_version"] == hvps.__version__ and a["created"].startswith("20")
    assert len(a["manifest_sha256"]) == 64


def test_compress_option_uses_lzf(tmp_path):
    mgr = CheckpointManager(tmp_path, compress=True)
    mgr.save(0, model={"z": np.zeros(100000, np.float32)})
    with h5py.File(tmp_path / file_name(0)) as f:
        assert f["model/z"].compression == "lzf"
    assert os.path.getsize(tmp_path / file_name(0)) < 100000
    assert mgr.load() == 1 and not mgr.loaded.model["z"].any()


def test_load_without_checkpoint_returns_zero(tmp_path):
    mgr = hvd.CheckpointManager(tmp_path / "none-yet")
    assert mgr.load(model=small_model()) == 0 and mgr.loaded is None
    with pytest.raises(CheckpointError, match="ckpt-epoch-000003.h5: no such checkpoint file"):
        mgr.load(3)


# ----------------------------------------------------------------------------- corruption
def _save_versions(tmp_path, epochs, keep_last=10):
    mgr = CheckpointManager(tmp_path, keep_last=keep_last)
    for e in epochs:
        mgr.save(e, model={"w": np.full(50000, e, np.float32), "b": np.arange(10) + e})
    return mgr


def _flip_byte_in_dataset(path, dataset, index=1000):
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + index)
        b = fh.read(1)
        fh.seek(offset + index)
        fh.write(bytes([b[0] ^ 0x10]))


def test_flipped_byte_detected_and_skipped(tmp_path):
    mgr = _save_versions(tmp_path, [0, 1, 2])
    bad = tmp_path / file_name(2)
    _flip_byte_in_dataset(bad, "model/w")
    with pytest.raises(CheckpointError) as exc:
        mgr.verify(2)
    assert str(bad) in str(exc.value) and "/model/w" in str(exc.value) and "checksum mismatch" in str(exc.value)
    with pytest.warns(RuntimeWarning, match="skipping checkpoint.*ckpt-epoch-000002") as by_latest:
        assert mgr.latest().epoch == 1
    with pytest.warns(RuntimeWarning, match="skipping") as by_load:
        assert mgr.load() == 2
    assert mgr.loaded.epoch == 1 and (mgr.loaded.model["w"] == 1).all()
    # each warning points at the line that called hvps, not into hvps's wrappers (load is timed by hvps.metrics)
    assert {w.filename for w in [*by_latest, *by_load]} == {__file__}
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        mgr.load(2)


def test_truncated_file_detected(tmp_path):
    mgr = _save_versions(tmp_path, [0, 1])
    bad = tmp_path / file_name(1)
    for size in (os.path.getsize(bad) - 100, os.path.getsize(bad) // 2, 100, 0):
        with open(bad, "r+b") as fh:
            fh.truncate(size)
        with pytest.raises(CheckpointError) as exc:
            mgr.verify(1)
        assert str(bad) in str(exc.value)
        assert "truncated" in str(exc.value) or "unreadable" in str(exc.value)
        with pytest.warns(RuntimeWarning, match="skipping"):
            assert mgr.latest().epoch == 0


def test_edited_attribute_and_extra_dataset_detected(tmp_path):
    mgr = _save_versions(tmp_path, [0])
    path = tmp_path / file_name(0)
    with h5py.File(path, "r+") as f:
        f.attrs["epoch"] = 5
    with pytest.raises(CheckpointError, match="root attribute epoch"):
        mgr.verify(0)
    with h5py.File(path, "r+") as f:
        f.attrs["epoch"] = 0
        f["model/injected"] = np.ones(3)
    with pytest.raises(CheckpointError, match="model/injected is in the file but not in the manifest"):
        mgr.verify(0)


def test_future_format_version_refused(tmp_path):
    mgr = _save_versions(tmp_path, [0])
    with h5py.File(tmp_path / file_name(0), "r+") as f:
        f.attrs["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(CheckpointError, match=r"format version 2 is not supported.*upgrade hvps"):
        mgr.load(0)


def test_other_model_reports_all_mismatches(tmp_path):
    mgr = hvd.CheckpointManager(tmp_path)
    mgr.save(0, model=small_model())
    other = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 10), torch.nn.Linear(10, 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError) as exc:
        mgr.load(model=other)
    err = exc.value
    assert str(tmp_path / file_name(0)) in str(err)
    assert "missing in checkpoint: model.4.weight" in err.problems
    assert any(p.startswith("shape mismatch: model.0.weight") for p in err.problems)
    assert len(err.problems) >= 6  # 2 missing + shapes of conv, bn (x4), linear
    for k, v in other.state_dict().items():  # nothing was changed
        assert torch.equal(v, before[k])
    # strict=False loads what fits
    extra_layer = torch.nn.Sequential(*small_model(), torch.nn.ReLU())
    with pytest.warns(RuntimeWarning) as caught:
        mgr.load(model=torch.nn.Sequential(*small_model(seed=5), torch.nn.Linear(10, 2)), strict=False)
    assert {w.filename for w in caught} == {__file__}
    del extra_layer


def test_optimizer_mismatch_reported(tmp_path):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, opt)
    mgr = hvd.CheckpointManager(tmp_path)
    mgr.save(0, model=model, optimizer=opt)
    with pytest.raises(CheckpointError, match="optimizer class: checkpoint SGD, given Adam"):
        mgr.load(model=small_model(), optimizer=torch.optim.Adam(small_model().parameters()))


def test_world_size_mismatch_for_per_rank_compression_state(tmp_path):
    attrs = root_attributes(3, None, 2, "numpy", np.__version__)
    sections = {"model": {"w": np.ones(3)},
                "compression": {"rank_00000": {"r": np.ones(2)}, "rank_00001": {"r": np.zeros(2)}}}
    tmp_path.mkdir(exist_ok=True)
    write_file(tmp_path / file_name(3), sections, attrs)
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match="saved per rank by 2 ranks but this job has 1.*drop_compression_state"):
        mgr.load(3)
    assert mgr.load(3, drop_compression_state=True) == 4
    assert mgr.loaded.compression_state == {} and (mgr.loaded.model["w"] == 1).all()
    # without per-rank state a different world size is fine
    write_file(tmp_path / file_name(4), {"model": {"w": np.ones(3)}}, root_attributes(4, None, 8, "numpy", "x"))
    assert mgr.load(4) == 5


# ----------------------------------------------------------------------------- retention, rollback
def test_retention_keep_last_and_every(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3, keep_every=4)
    for e in range(11):
        mgr.save(e, model={"w": np.full(10, e)})
        kept = [v.epoch for v in mgr.list()]
        expect = sorted(set(range(max(0, e - 2), e + 1)) | {x for x in range(e + 1) if x % 4 == 0})
        assert kept == expect
    assert [v.epoch for v in mgr.list()] == [0, 4, 8, 9, 10]


def test_rollback_and_undo(tmp_path):
    mgr = _save_versions(tmp_path, range(5))
    moved = mgr.rollback(2)
    assert sorted(p.name for p in moved) == [file_name(3), file_name(4)]
    assert all(p.parent.parent == tmp_path / "attic" and p.exists() for p in moved)
    assert [v.epoch for v in mgr.list()] == [0, 1, 2]
    assert mgr.load() == 3 and mgr.loaded.epoch == 2
    restored = mgr.undo_rollback()
    assert sorted(p.name for p in restored) == [file_name(3), file_name(4)]
    assert [v.epoch for v in mgr.list()] == [0, 1, 2, 3, 4] and mgr.latest().epoch == 4
    assert mgr.rollbacks() == []
    # undo refuses to overwrite versions written after the rollback unless forced
    mgr.rollback(1)
    mgr.save(2, model={"w": np.full(3, 42.0)})
    with pytest.raises(CheckpointError, match="written since") as exc:
        mgr.undo_rollback()
    assert str(tmp_path / file_name(2)) in exc.value.problems
    mgr.undo_rollback(force=True)
    assert [v.epoch for v in mgr.list()] == [0, 1, 2, 3, 4]
    displaced = list((tmp_path / "attic").glob("displaced-*/" + file_name(2)))
    assert len(displaced) == 1
    with pytest.raises(CheckpointError, match="no version for epoch 9"):
        mgr.rollback(9)


# ----------------------------------------------------------------------------- crash safety
WRITER = textwrap.dedent("""
    import sys, numpy as np
    from hvps.checkpoint import CheckpointManager
    mgr = CheckpointManager(sys.argv[1], keep_last=2)
    start = int(sys.argv[2])
    for epoch in range(start, start + 10000):
        mgr.save(epoch, model={f"t{i}": np.full(262144, epoch * 100 + i, np.float32) for i in range(4)},
                 optimizer={"state": {"0": {"m": np.full(262144, -epoch, np.float32)}}})
        if epoch == start:
            print("ready", flush=True)
""")


def test_kill_9_during_save_never_loses_the_previous_version(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    ckdir = tmp_path / "ck"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    rng = random.Random(1234)
    newest = -1
    saw_temp = 0
    for trial in range(15):
        proc = subprocess.Popen([sys.executable, str(script), str(ckdir), str(newest + 1)], env=env,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        saw_temp += any(p.name.startswith(".ckpt-") for p in ckdir.iterdir())
        mgr = CheckpointManager(ckdir, keep_last=2)
        v = mgr.latest()  # must not warn: no file with a final name is ever partial
        assert v is not None and v.epoch >= newest + 1
        for other in mgr.list():
            mgr.verify(other.epoch)
        assert mgr.load() == v.epoch + 1
        model = mgr.loaded.model
        for i in range(4):
            assert (model[f"t{i}"] == v.epoch * 100 + i).all()
        assert (mgr.loaded.optimizer["state"]["0"]["m"] == -v.epoch).all()
        newest = v.epoch
    # the next save cleans up temporaries of killed writers
    CheckpointManager(ckdir, keep_last=2).save(newest + 1, model={"x": np.ones(1)})
    assert not any(p.name.startswith(".ckpt-") for p in ckdir.iterdir())
    print(f"temporary files left by a kill in {saw_temp} of 15 trials")


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs (needs root): {res.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_leaves_previous_versions_intact(tiny_tmpfs):
    mgr = CheckpointManager(tiny_tmpfs, keep_last=5)
    for e in range(2):
        mgr.save(e, model={"w": np.full(40000, e, np.float32)})  # 160 KB each
    with pytest.raises(CheckpointError) as exc:
        mgr.save(2, model={"w": np.ones(400000, np.float32)})  # 1.6 MB > 1 MiB
    assert "ckpt-epoch-000002.h5" in str(exc.value)
    assert [v.epoch for v in mgr.list()] == [0, 1]
    assert not any(p.name.startswith(".ckpt-") for p in tiny_tmpfs.iterdir()), "temporary file left behind"
    assert mgr.latest().epoch == 1
    assert mgr.load() == 2 and (mgr.loaded.model["w"] == 1).all()
    mgr.save(2, model={"w": np.full(40000, 2, np.float32)})  # space is back after the cleanup
    assert mgr.latest().epoch == 2
