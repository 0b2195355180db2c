"""Synthetic ResNet-50 training throughput with hvps (after Horovod's
examples/pytorch/pytorch_synthetic_benchmark.py). Launch under mpirun, e.g.::

    mpirun -np 2 --bind-to none --map-by slot python benchmarks/pytorch_synthetic_benchmark.py \\
        --threads-per-rank 1 --compare-no-comm --baseline --json out/resnet50.json

Measurements (each iteration = --num-batches-per-iter steps of forward,
cross-entropy, backward, optimizer step on random data; images/s per rank per
iteration; 95% CIs use Student's t over iterations):

* distributed (default): ``hvd.DistributedOptimizer``; its exposed
  communication wait is timed as ``optimizer.synchronize()`` before
  ``with optimizer.skip_synchronize(): optimizer.step()``, and the
  communication share is that wait over the step time.
* --no-comm: only a plain optimizer on all ranks at once (hvps not even
  initialised): the throughput ceiling under the same CPU contention.
* --compare-no-comm: distributed and no-comm phases alternate in one launch
  (A B A B ..., --rounds rounds, two model replicas so no hooks fire in B);
  reports dist/no-comm images/s as the median over rounds of per-round median
  ratios (target >= 0.97) and how much of the step-time gap is communication wait.
* --compare-plain: the same rounds against a plain PyTorch loop (same model,
  optimizer, batch and data; no hvps call in it); JSON ``ratio_vs_plain``,
  ``hvps_img_sec_per_rank`` and ``plain_img_sec_per_rank``. With 1 rank this is
  the device check: hvps reaches >= 0.97x the plain loop's images/s.
* --cuda: one GPU per rank (``torch.cuda.set_device(hvd.local_rank())``); each
  iteration ends with ``torch.cuda.synchronize()``, so images/s are device
  times, while step/wait/forward+backward seconds are host-side. The JSON's
  ``gpu`` lists per rank torch's peak allocated memory and, through pynvml
  (the ``gpu`` extra), the GPU's memory used/total (MiB) and utilisation (%)
  sampled during the timed phases (None plus ``nvml_reason`` when unreadable).
  --amp adds bf16 autocast around forward and loss (CPU too).
* --baseline: afterwards rank 0 alone runs the no-comm workload while the
  other ranks sleep in a non-spinning barrier; scaling efficiency =
  total images/s / (ranks * single-rank images/s).
* --epochs N (distributed mode only): train N epochs, an epoch being one
  measurement, i.e. --num-iters x --num-batches-per-iter batches; the result
  pools the epochs run in this launch.  --checkpoint-dir DIR saves an
  ``hvd.CheckpointManager`` version (model, optimizer, this rank's compression
  state) collectively after every epoch; --resume loads the latest valid one
  after warm-up and continues with the next epoch (from scratch if there is
  none).  ``hvpsrun --max-restarts N --checkpoint-dir DIR ... --resume``
  recovers a crashed run; --resume alone takes DIR from HVPS_CHECKPOINT_DIR.

Defaults (batch 32, 224 px, 10 warm-up batches, 10 iterations of 10 batches)
are Horovod's and are meant for a real cluster; on a small CPU box pass e.g.
--batch-size 4 --image-size 64 --num-warmup-batches 2 --num-batches-per-iter 2
--num-iters 3. Logs and JSON come from rank 0 only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Progress, idle_barrier, median, summarize, write_json  # noqa: E402
from hvps.metrics import energy  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("resnet50",), default="resnet50", help="model to train (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per batch (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=224, help="square input side in pixels (default: %(default)s)")
    p.add_argument("--num-classes", type=int, default=1000, help="classifier outputs (default: %(default)s)")
    p.add_argument("--num-warmup-batches", type=int, default=10,
                   help="untimed batches before measuring, per model replica (default: %(default)s)")
    p.add_argument("--num-batches-per-iter", type=int, default=10,
                   help="batches per timed iteration (default: %(default)s)")
    p.add_argument("--num-iters", type=int, default=10,
                   help="timed iterations per measurement (per phase with --compare-*) (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="--compare-no-comm / --compare-plain: alternating rounds (default: %(default)s)")
    p.add_argument("--fp16-allreduce", action="store_true",
                   help="compress gradients to fp16 for the allreduce (Horovod's flag; same as --compression fp16)")
    p.add_argument("--compression", choices=("none", "fp16", "bf16", "int8", "topk", "dgc", "powersgd"),
                   default="none",
                   help="gradient compression: casts, 8-bit quantisation, top-k with error feedback, DGC, or "
                        "PowerSGD at --powersgd-rank (compressing from the first step) (default: %(default)s)")
    p.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD's matrix rank (default: %(default)s)")
    p.add_argument("--density", type=float, default=0.01,
                   help="fraction of gradient entries top-k and DGC send, in (0, 1] (default: %(default)s)")
    p.add_argument("--threads-per-rank", type=int, default=1,
                   help="torch intra-op and inter-op threads per rank (default: %(default)s)")
    p.add_argument("--inter-op-threads", type=int, default=None,
                   help="inter-op threads per rank, if not --threads-per-rank (TensorFlow: with 1 its executor runs "
                        "the whole backward pass before any gradient bucket's allreduce starts)")
    p.add_argument("--channels-last", action="store_true", help="use torch.channels_last for model and data")
    p.add_argument("--cuda", action="store_true",
                   help="train on the GPU: torch.cuda.set_device(local rank), model and synthetic data on it, "
                        "cudnn.benchmark (as Horovod's examples); the JSON gets GPU memory and utilisation")
    p.add_argument("--amp", action="store_true",
                   help="bf16 autocast (torch.autocast) around forward and loss, on GPU or CPU")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate, scaled by ranks (default: %(default)s)")
    p.add_argument("--no-comm", action="store_true",
                   help="plain optimizer on every rank, no communication (contention ceiling)")
    p.add_argument("--compare-no-comm", action="store_true",
                   help="alternate distributed and no-comm phases in this launch and report their ratio")
    p.add_argument("--compare-plain", action="store_true",
                   help="alternate the hvps loop with a plain PyTorch loop (same model, optimizer and data, no hvps "
                        "call) in this launch and report hvps/plain images/s (target >= 0.97; on 1 rank: the "
                        "framework's overhead)")
    p.add_argument("--baseline", action="store_true",
                   help="also time rank 0 alone (others idle) and report scaling efficiency")
    p.add_argument("--no-comm-ref", default="",
                   help="JSON of an earlier --no-comm run to compare the distributed run against")
    p.add_argument("--epochs", type=int, default=None,
                   help="distributed mode: train this many epochs of --num-iters x --num-batches-per-iter "
                        "batches (default: one measurement, no epochs; 1 with --checkpoint-dir)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save an hvps checkpoint here after every epoch (all ranks collectively)")
    p.add_argument("--resume", action="store_true",
                   help="load the latest checkpoint from --checkpoint-dir (or $HVPS_CHECKPOINT_DIR) and continue "
                        "with the next epoch")
    p.add_argument("--keep-last", type=int, default=3, help="checkpoint versions kept (default: %(default)s)")
    p.add_argument("--json", default="", help="write the results to this JSON file (rank 0)")
    p.add_argument("--progress", action="store_true",
                   help="tqdm progress bar on rank 0 (for a terminal: a launcher that tags output by rank, such as "
                        "hvpsrun, shows it only at the end; without it rank 0 logs a line per iteration)")
    args = p.parse_args(argv)
    if sum((args.no_comm, args.compare_no_comm, args.compare_plain)) > 1:
        p.error("--no-comm, --compare-no-comm and --compare-plain exclude each other")
    if args.cuda:
        import torch

        if not torch.cuda.is_available():
            p.error(f"--cuda: torch.cuda.is_available() is False (torch {torch.__version__}, "
                    f"built for CUDA {torch.version.cuda}); run without --cuda")
    if args.fp16_allreduce:
        if args.compression not in ("none", "fp16"):
            p.error("--fp16-allreduce and --compression exclude each other; use --compression fp16")
        args.compression = "fp16"
    if not 0 < args.density <= 1:
        p.error(f"--density must be in (0, 1], got {args.density}")
    if args.resume and not args.checkpoint_dir:
        args.checkpoint_dir = os.environ.get("HVPS_CHECKPOINT_DIR") or None
        if not args.checkpoint_dir:
            p.error("--resume needs --checkpoint-dir DIR (or HVPS_CHECKPOINT_DIR in the environment)")
    if args.epochs is not None or args.checkpoint_dir:
        if args.no_comm or args.compare_no_comm or args.compare_plain:
            p.error("--epochs, --checkpoint-dir and --resume work in the plain distributed mode only "
                    "(not with --no-comm, --compare-no-comm or --compare-plain)")
        if args.epochs is None:
            args.epochs = 1
        if args.epochs < 1:
            p.error(f"--epochs must be >= 1, got {args.epochs}")
    return args


class Trainer:
    """One model replica with its optimizer on ``device``; ``step()`` returns
    (step_s, comm_wait_s, forward_backward_s). With ``hvd`` None it is a plain
    PyTorch loop that makes no hvps call."""

    def __init__(self, args: argparse.Namespace, hvd: Any | None, ranks: int, device: Any = "cpu") -> None:
        import functools

        import torch
        from torch.nn import functional as F

        from benchmarks.resnet import resnet50

        self.F, self.hvd, self.device = F, hvd, torch.device(device)
        self.autocast = functools.partial(torch.autocast, self.device.type, dtype=torch.bfloat16, enabled=args.amp)
        self.synchronize_device = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        fmt = torch.channels_last if args.channels_last else torch.contiguous_format
        self.model = resnet50(num_classes=args.num_classes).to(self.device, memory_format=fmt)
        # DGC applies momentum itself (momentum correction), so its optimizer has none.
        momentum = 0.0 if (hvd is not None and args.compression == "dgc") else 0.9
        opt = torch.optim.SGD(self.model.parameters(), lr=args.lr * ranks, momentum=momentum)
        if hvd is not None:
            opt = hvd.DistributedOptimizer(opt, named_parameters=self.model.named_parameters(),
                                           compression=create_compression(args))
            hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        self.opt = opt
        #: hvps.metrics.record_samples (samples/s on the Grafana dashboard), or None in the plain loop
        self.record_samples = None
        if hvd is not None:
            from hvps.metrics import record_samples

            self.record_samples = record_samples
        #: the gradient compression whose stats the harness reports (None in the plain loop)
        self.compression = getattr(opt, "compression", None)
        gen = torch.Generator().manual_seed(0)
        self.data = torch.randn(args.batch_size, 3, args.image_size, args.image_size,
                                generator=gen).to(self.device).contiguous(memory_format=fmt)
        self.target = torch.randint(0, args.num_classes, (args.batch_size,), generator=gen).to(self.device)

    def step(self) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        self.opt.zero_grad()
        with self.autocast():
            loss = self.F.cross_entropy(self.model(self.data), self.target)
        loss.backward()
        fwd_bwd = time.perf_counter() - t0
        wait = 0.0
        if self.hvd is not None:
            tw = time.perf_counter()
            self.opt.synchronize()
            wait = time.perf_counter() - tw
            with self.opt.skip_synchronize():
                self.opt.step()
            self.record_samples(len(self.target))
        else:
            self.opt.step()
        return time.perf_counter() - t0, wait, fwd_bwd


def result_header(args: argparse.Namespace, benchmark: str, ranks: int) -> dict[str, Any]:
    """The JSON fields that describe the run, common to both harnesses."""
    return {"benchmark": benchmark, "model": args.model, "ranks": ranks, "threads_per_rank": args.threads_per_rank,
            "batch_size": args.batch_size, "image_size": args.image_size,
            "num_batches_per_iter": args.num_batches_per_iter, "num_iters": args.num_iters,
            "compression": args.compression,
            "density": args.density if args.compression in ("topk", "dgc") else None,
            "channels_last": args.channels_last}


def warm_up(args: argparse.Namespace, *trainers: Any) -> None:
    """``--num-warmup-batches`` untimed steps of every trainer that exists."""
    for trainer in trainers:
        if trainer is not None:
            for _ in range(args.num_warmup_batches):
                trainer.step()


def create_compression(args: argparse.Namespace) -> Any:
    """The core compression ``--compression`` / ``--density`` ask for (DGC without warm-up), one
    object per trainer so that error feedback persists across steps."""
    from hvps import compression

    options = {"density": args.density, "warmup": ()} if args.compression == "dgc" else (
        {"density": args.density} if args.compression == "topk" else {})
    if args.compression == "powersgd":
        options = {"rank": args.powersgd_rank, "start_iter": 0}
    return compression.create(args.compression, **options)


def phase_runner(comm: Any, args: argparse.Namespace, tick: Callable[[str], None]) -> Callable[..., Any]:
    """``phase(trainer, mode)``: one measurement on every rank, after a barrier; rank 0 gets the
    ranks' results combined, with the bytes and times of ``trainer.compression`` where it has one,
    and the energy the phase took (NVML on a GPU; RAPL on a CPU host, read by its local rank 0)."""
    from mpi4py import MPI

    from hvps.metrics.energy import EnergyMeter

    rank = comm.Get_rank()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank = node.Get_rank()
    node.Free()

    def phase(trainer: Any, mode: str) -> dict[str, Any] | None:
        comm.Barrier()
        if trainer.compression is not None:
            trainer.compression.stats.reset()
        device = getattr(trainer, "device", None)
        meter = EnergyMeter(cuda_index=device.index if getattr(device, "type", "") == "cuda" else None,
                            reads_host=local_rank == 0).start()
        timings = measure(trainer, args, tick)
        timings["energy"] = meter.stop()
        if trainer.compression is not None:
            timings["compression"] = trainer.compression.stats.as_dict()
        gathered = comm.gather(timings, root=0)
        return combine(gathered, args, mode) if rank == 0 else None

    return phase


def measure(trainer: Trainer, args: argparse.Namespace, tick: Callable[[str], None]) -> dict[str, list[float]]:
    """Time ``--num-iters`` iterations on this rank: images/s, step, wait and
    forward+backward seconds. An iteration's clock stops after the device has
    finished its work (``trainer.synchronize_device``, where the trainer has one)."""
    sync = getattr(trainer, "synchronize_device", None) or (lambda: None)
    img_s, step_s, wait_s, fb_s = [], [], [], []
    for _ in range(args.num_iters):
        sync()
        t0 = time.perf_counter()
        steps = [trainer.step() for _ in range(args.num_batches_per_iter)]
        sync()
        elapsed = time.perf_counter() - t0
        img_s.append(args.batch_size * args.num_batches_per_iter / elapsed)
        step_s.append(sum(s[0] for s in steps))
        wait_s.append(sum(s[1] for s in steps))
        fb_s.append(sum(s[2] for s in steps))
        tick(f"{img_s[-1]:.1f} img/s (rank 0)")
    return {"img_s": img_s, "step_s": step_s, "wait_s": wait_s, "fb_s": fb_s}


def combine(per_rank: list[dict[str, list[float]]], args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """Merge the per-rank lists that rank 0 gathered into one result."""
    n = len(per_rank)
    iters = list(zip(*(r["img_s"] for r in per_rank)))
    step, wait = sum(sum(r["step_s"]) for r in per_rank), sum(sum(r["wait_s"]) for r in per_rank)
    fwd_bwd = sum(sum(r["fb_s"]) for r in per_rank)
    steps = n * len(iters) * args.num_batches_per_iter
    wire = _wire(per_rank, steps // n if n else 0)
    images = steps * args.batch_size
    return {"mode": mode, "ranks": n, **wire,
            "energy": energy.combine([r.get("energy") for r in per_rank], images),
            "per_rank_img_s": summarize(statistics.fmean(it) for it in iters),
            "total_img_s": summarize(sum(it) for it in iters),
            "per_rank_mean_img_s": [statistics.fmean(r["img_s"]) for r in per_rank],
            "step_time_s": step / steps if steps else None,
            "comm_wait_s_per_step": wait / steps if steps else None,
            "forward_backward_s_per_step": fwd_bwd / steps if steps else None,
            "comm_share": wait / step if step else 0.0}


def _wire(per_rank: list[dict[str, Any]], steps_per_rank: int) -> dict[str, Any]:
    """Bytes each rank sent and received per step, and compression time, averaged over ranks."""
    stats = [r["compression"] for r in per_rank if "compression" in r]
    if not stats or not steps_per_rank:
        return {}

    def per_step(key: str) -> float:
        return statistics.fmean(s[key] for s in stats) / steps_per_rank

    return {"bytes_sent_per_step": per_step("bytes_sent"), "bytes_received_per_step": per_step("bytes_received"),
            "dense_bytes_per_step": per_step("dense_bytes"),
            "compression_ratio": statistics.fmean(s["ratio"] for s in stats),
            "compress_s_per_step": per_step("compress_seconds"),
            "decompress_s_per_step": per_step("decompress_seconds")}


def gap_analysis(dist: dict[str, Any], ceiling: dict[str, Any], ref: str = "no_comm") -> dict[str, Any]:
    """How much of the mean step-time gap between the reference ``ref`` (no_comm or
    plain) and distributed is the exposed comm wait (both means over all steps of all
    ranks; on a GPU these are host-side times)."""
    gap = dist["step_time_s"] - ceiling["step_time_s"]
    return {"reference": ref,
            f"dist_over_{ref}": dist["per_rank_img_s"]["median"] / ceiling["per_rank_img_s"]["median"],
            "step_time_s": dist["step_time_s"], f"{ref}_step_time_s": ceiling["step_time_s"],
            "step_gap_s": gap, "comm_wait_s_per_step": dist["comm_wait_s_per_step"],
            "forward_backward_gap_s": (dist["forward_backward_s_per_step"] - ceiling["forward_backward_s_per_step"]
                                       if "forward_backward_s_per_step" in ceiling else None),
            "comm_fraction_of_gap": dist["comm_wait_s_per_step"] / gap if gap > 0 else None}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads_per_rank)
    try:
        torch.set_num_interop_threads(args.inter_op_threads or args.threads_per_rank)
    except RuntimeError:  # already set or parallel work started
        pass
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()  # private communicator for the harness's own sync
    rank, size = comm.Get_rank(), comm.Get_size()
    hvd = None
    if not args.no_comm:
        import hvps.adapters.torch as hvd
        hvd.init()
        assert hvd.size() == size and hvd.rank() == rank, "hvps and MPI disagree on rank/size"
    device = torch.device("cpu")
    if args.cuda:  # one GPU per rank, as in Horovod's examples
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank = hvd.local_rank() if hvd is not None else node.Get_rank()
        node.Free()
        torch.cuda.set_device(local_rank)
        torch.backends.cudnn.benchmark = True
        device = torch.device("cuda", local_rank)
    ref = reference(args)

    phases = args.rounds * 2 if ref else (args.epochs or 1)
    total = args.num_iters * (phases + int(args.baseline and rank == 0))
    progress = Progress(total, rank, args.progress)
    tick, log = progress.tick, progress.log

    log(f"Model: {args.model}, batch size {args.batch_size}, image size {args.image_size}, "
        f"ranks {size}, threads per rank {args.threads_per_rank}, compression {args.compression}, "
        f"channels_last {args.channels_last}, device {device}, bf16 autocast {args.amp}")
    dist = Trainer(args, hvd, size, device) if hvd is not None else None
    local = Trainer(args, None, size, device) if (args.no_comm or ref or args.baseline) else None
    warm_up(args, dist, local)
    sampler = None
    if args.cuda:
        from benchmarks.gpu_stats import NvmlSampler

        sampler = NvmlSampler(device.index).start()

    phase = phase_runner(comm, args, tick)
    result = result_header(args, "pytorch_synthetic", size)
    result.update(device=device.type, amp_bf16=args.amp)
    if args.epochs is not None:
        main_res = run_epochs(args, dist, hvd, phase, log, result)
    else:
        main_res = run_phases(args, dist, local, phase, rank, log, result)
    run_baseline(args, comm, local, tick, main_res, result)
    progress.close()
    if args.cuda:
        from benchmarks.gpu_stats import cuda_report

        gpus = comm.gather({"rank": rank, **cuda_report(device, sampler)}, root=0)
        result["gpu"] = gpus
    else:
        result.update(gpu=None, gpu_reason="CPU run (no --cuda)")

    if hvd is not None:  # what HVPS_AUTOTUNE=1 tried and chose (rank 0; None when off)
        import hvps

        result["autotune"] = hvps.autotune_report()
    if rank == 0:
        if main_res is not None:
            result.update(energy_fields(main_res))
            _summary(result, main_res, log)
        write_json(args.json, result)
        print(json.dumps(result, default=float), flush=True)
    if hvd is not None and hasattr(hvd, "shutdown"):
        hvd.shutdown()
    comm.Free()
    return result if rank == 0 else None


def energy_fields(main_res: dict[str, Any]) -> dict[str, Any]:
    """The main measurement's energy as top-level JSON fields (None and the reason where unreadable)."""
    e = main_res.get("energy") or energy.combine([], None)
    return {"joules_per_image": e["joules_per_image"], "avg_watts": e["watts"], "energy_joules": e["joules"],
            "energy_source": e["source"], "energy_reason": e["reason"]}


def reference(args: argparse.Namespace) -> str | None:
    """The loop the hvps loop is compared with in this launch: "plain", "no_comm" or None."""
    return "plain" if args.compare_plain else "no_comm" if args.compare_no_comm else None


def run_phases(args: argparse.Namespace, dist: Any, local: Any, phase: Callable[..., Any], rank: int,
               log: Callable[..., None], result: dict[str, Any]) -> dict[str, Any] | None:
    """The measurements both harnesses make: rounds of the hvps loop against the reference loop
    (A B A B ...; --compare-no-comm / --compare-plain), or one phase. Fills ``result`` on rank 0
    and returns the hvps loop's pooled results there."""
    ref = reference(args)
    if not ref:
        main_res = phase(local if args.no_comm else dist, "no_comm" if args.no_comm else "distributed")
        if rank == 0:
            result[main_res["mode"]] = main_res
            if args.no_comm_ref and not args.no_comm:
                ref_res = json.loads(Path(args.no_comm_ref).read_text())["no_comm"]
                result["no_comm_ref"] = ref_res
                result["gap"] = gap_analysis(main_res, ref_res)
        return main_res
    rounds = []
    for r in range(args.rounds):
        a, b = phase(dist, "distributed"), phase(local, ref)
        if rank == 0:
            ratio = a["per_rank_img_s"]["median"] / b["per_rank_img_s"]["median"]
            rounds.append({"distributed": a, ref: b, "ratio": ratio})
            log(f"Round {r + 1}/{args.rounds}: distributed {a['per_rank_img_s']['median']:.2f}, "
                f"{ref.replace('_', '-')} {b['per_rank_img_s']['median']:.2f} img/s per rank, ratio {ratio:.3f}")
    if rank != 0:
        return None
    main_res = _pool([x["distributed"] for x in rounds], "distributed")
    ceiling = _pool([x[ref] for x in rounds], ref)
    ratios = [x["ratio"] for x in rounds]
    ratio_info = {"median_of_round_ratios": median(ratios), "per_round": ratios, "target": 0.97}
    result.update({"distributed": main_res, ref: ceiling, "rounds": rounds,
                   "gap": gap_analysis(main_res, ceiling, ref)})
    if ref == "no_comm":
        result["dist_over_no_comm"] = ratio_info
    else:
        result.update(hvps_img_sec_per_rank=main_res["per_rank_img_s"]["median"],
                      plain_img_sec_per_rank=ceiling["per_rank_img_s"]["median"],
                      ratio_vs_plain=ratio_info["median_of_round_ratios"], vs_plain=ratio_info)
    return main_res


def run_baseline(args: argparse.Namespace, comm: Any, local: Any, tick: Callable[[str], None],
                 main_res: dict[str, Any] | None, result: dict[str, Any]) -> None:
    """--baseline: rank 0 alone runs the reference loop while the others sleep in a
    non-spinning barrier; adds the single-rank results and the scaling efficiencies."""
    if not args.baseline:
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    comm.Barrier()
    if rank == 0:
        single = combine([measure(local, args, tick)], args, "single_rank")
        result["single_rank"] = single
        if main_res is not None:
            result["scaling_efficiency"] = (main_res["total_img_s"]["median"]
                                            / (size * single["per_rank_img_s"]["median"]))
            if "no_comm" in result and not args.no_comm:
                result["no_comm_scaling_efficiency"] = (result["no_comm"]["total_img_s"]["median"]
                                                        / (size * single["per_rank_img_s"]["median"]))
    idle_barrier(comm)


def run_epochs(args: argparse.Namespace, dist: Trainer, hvd: Any, phase: Callable[..., Any],
               log: Callable[..., None], result: dict[str, Any]) -> dict[str, Any] | None:
    """--epochs: resume (--resume), then one measurement per epoch, each followed by a
    collective checkpoint save (--checkpoint-dir). Rank 0 returns the epochs pooled."""
    ckpt = hvd.CheckpointManager(args.checkpoint_dir, keep_last=args.keep_last) if args.checkpoint_dir else None
    start = 0
    if ckpt is not None and args.resume:
        start = ckpt.load(model=dist.model, optimizer=dist.opt, compression=dist.opt.compression)
        log(f"Resuming from {ckpt.loaded.path} at epoch {start}" if ckpt.loaded is not None
            else f"No checkpoint in {args.checkpoint_dir}: starting at epoch 0")
    info: dict[str, Any] = {"epochs": args.epochs, "start_epoch": start, "checkpoint_dir": args.checkpoint_dir,
                            "restart_count": int(os.environ.get("HVPS_RESTART_COUNT", "0") or 0), "save_s": []}
    per_epoch = []
    for epoch in range(start, args.epochs):
        dist.opt.set_epoch(epoch)
        res = phase(dist, "distributed")
        if ckpt is not None:
            t0 = time.perf_counter()
            path = ckpt.save(epoch, model=dist.model, optimizer=dist.opt, compression_state=dist.opt.compression,
                             extra={"harness": "pytorch_synthetic_benchmark", "model": args.model})
            info["save_s"].append(time.perf_counter() - t0)
            log(f"Epoch {epoch + 1}/{args.epochs} done; checkpoint {path} ({info['save_s'][-1]:.2f} s)")
        else:
            log(f"Epoch {epoch + 1}/{args.epochs} done")
        per_epoch.append(res)
    result["epochs"] = info
    if dist.hvd.rank() != 0:
        return None
    if not per_epoch:  # everything was done before this launch
        log(f"All {args.epochs} epochs were done already")
        return None
    main_res = per_epoch[0] if len(per_epoch) == 1 else _pool(per_epoch, "distributed")
    result["distributed"] = main_res
    return main_res


def _pool(results: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Pool several phase results of one mode (per-iteration data is not kept, so
    pool the per-phase means; CI is over phases)."""
    per_rank = summarize(r["per_rank_img_s"]["median"] for r in results)
    total = summarize(r["total_img_s"]["median"] for r in results)
    step = statistics.fmean(r["step_time_s"] for r in results)
    wait = statistics.fmean(r["comm_wait_s_per_step"] for r in results)
    fwd_bwd = statistics.fmean(r["forward_backward_s_per_step"] for r in results)
    wire_keys = [k for k in results[0] if k.endswith("_per_step") and k.startswith(("bytes", "dense", "compress",
                                                                                     "decompress"))]
    wire = {k: statistics.fmean(r[k] for r in results) for k in wire_keys}
    if "compression_ratio" in results[0]:
        wire["compression_ratio"] = statistics.fmean(r["compression_ratio"] for r in results)
    return {"mode": mode, "ranks": results[0]["ranks"], "pooled_over_rounds": len(results), **wire,
            "energy": energy.pool([r.get("energy") for r in results]),
            "per_rank_img_s": per_rank, "total_img_s": total, "step_time_s": step,
            "comm_wait_s_per_step": wait, "forward_backward_s_per_step": fwd_bwd,
            "comm_share": wait / step if step else 0.0}


def _summary(result: dict[str, Any], main_res: dict[str, Any], log: Callable[..., None]) -> None:
    """Human-readable closing lines (rank 0)."""
    def ci(s: dict[str, Any]) -> str:
        half = s.get("ci_half_width")
        return f"{s['mean']:.2f} +-{half:.2f} (95% CI)" if half is not None else f"{s['mean']:.2f}"

    n = result["ranks"]
    label = "no-comm" if main_res["mode"] == "no_comm" else "distributed"
    log(f"Img/sec per rank ({label}): {ci(main_res['per_rank_img_s'])}")
    log(f"Total img/sec on {n} rank(s): {ci(main_res['total_img_s'])}")
    if main_res["mode"] == "distributed":
        log(f"Communication share of step time: {100 * main_res['comm_share']:.1f}% "
            f"({1e3 * main_res['comm_wait_s_per_step']:.1f} ms exposed wait per step)")
        if "bytes_sent_per_step" in main_res:
            log(f"Bytes sent per step and rank: {main_res['bytes_sent_per_step'] / 2**20:.2f} MiB "
                f"({main_res['compression_ratio']:.1f}x fewer than dense), compress "
                f"{1e3 * main_res['compress_s_per_step']:.1f} ms, decompress "
                f"{1e3 * main_res['decompress_s_per_step']:.1f} ms per step")
    if "joules_per_image" in result:
        log(f"Energy: {result['joules_per_image']:.3f} J/image, {result['avg_watts']:.1f} W average "
            f"({result['energy_source']})" if result["joules_per_image"] is not None
            else f"Energy: n/a ({result['energy_reason']})")
    if "dist_over_no_comm" in result:
        d = result["dist_over_no_comm"]
        log(f"Distributed / no-comm img/sec: {d['median_of_round_ratios']:.3f} (median of "
            f"{len(d['per_round'])} rounds; target >= 0.97)")
    if "ratio_vs_plain" in result:
        log(f"hvps / plain PyTorch img/sec: {result['ratio_vs_plain']:.3f} (median of "
            f"{len(result['vs_plain']['per_round'])} rounds; target >= 0.97); per rank: hvps "
            f"{result['hvps_img_sec_per_rank']:.2f}, plain {result['plain_img_sec_per_rank']:.2f}")
    if result.get("gap", {}).get("comm_fraction_of_gap") is not None:
        g = result["gap"]
        fb, ref = g["forward_backward_gap_s"], g.get("reference", "no_comm").replace("_", "-")
        log(f"Communication wait explains {100 * g['comm_fraction_of_gap']:.0f}% of the "
            f"{1e3 * g['step_gap_s']:.1f} ms step-time gap to {ref}"
            + (f" (forward+backward is {1e3 * fb:.1f} ms slower than in {ref})" if fb is not None else ""))
    for gpu in result.get("gpu") or ():
        nvml = (f"NVML: {gpu['memory_used_mib']:.0f} of {gpu['memory_total_mib']:.0f} MiB used, "
                f"{gpu['utilization_pct']:.0f}% utilisation" if gpu.get("utilization_pct") is not None
                else f"NVML: n/a ({gpu.get('nvml_reason')})")
        log(f"GPU rank {gpu['rank']} {gpu['name']}: torch max allocated "
            f"{gpu['torch_max_memory_allocated_mib']:.0f} MiB; {nvml}")
    if "single_rank" in result:
        log(f"Single-rank img/sec: {ci(result['single_rank']['per_rank_img_s'])}")
        log(f"Scaling efficiency: {100 * result['scaling_efficiency']:.1f}%")
        if "no_comm_scaling_efficiency" in result:
            log(f"No-comm scaling efficiency (contention only): {100 * result['no_comm_scaling_efficiency']:.1f}%")


if __name__ == "__main__":
    main()
