"""``hvps ckpt list|inspect|verify|rollback DIR``: the checkpoint verbs of the ``hvps`` command."""

from __future__ import annotations

import json
import re
import sys


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every control character but newline escaped (a checkpoint's strings
    are someone else's: escape sequences must not reach the terminal)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _emit(args, obj, text_lines: list) -> None:
    if args.json:  # json.dumps escapes control characters itself
        print(json.dumps(obj, indent=2, sort_keys=False, default=str))
    else:
        print(printable("\n".join(text_lines)))


def _ckpt_list(args) -> int:
    from .format import CheckpointError
    from .inspect import verify_file
    from .manager import header_of
    from .versions import CheckpointVersions

    mgr = CheckpointVersions(args.dir)
    rows = []
    for v in mgr.list():
        row = {"epoch": v.epoch, "path": str(v.path), "bytes": v.size}
        try:
            h = verify_file(v.path) if args.verify else header_of(v.path)
            row.update(step=h.attrs.get("step"), world_size=h.attrs.get("world_size"),
                       created=h.attrs.get("created"), framework=h.attrs.get("framework"),
                       status="verified" if args.verify else "readable")
        except CheckpointError as exc:
            row.update(status="BAD", error=str(exc))
        rows.append(row)
    rollbacks = [str(p) for p in mgr.rollbacks()]
    lines = [f"{args.dir}: {len(rows)} version(s)" + ("" if args.verify else " (header check only; --verify reads all data)")]
    if rows:
        lines.append(f"{'epoch':>7}  {'step':>8}  {'size':>10}  {'ranks':>5}  {'created (UTC)':<29}  status")
        for r in rows:
            step = r.get("step")
            lines.append(f"{r['epoch']:>7}  {'-' if step in (None, -1) else step:>8}  {_fmt_bytes(r['bytes']):>10}  "
                         f"{r.get('world_size', '?')!s:>5}  {r.get('created', '?')!s:<29}  {r['status']}"
                         + (f": {r['error'].splitlines()[0]}" if "error" in r else ""))
    if rollbacks:
        lines.append(f"attic: {len(rollbacks)} rollback(s); undo the last with 'hvps ckpt rollback {args.dir} --undo'")
    _emit(args, {"directory": str(args.dir), "versions": rows, "rollbacks": rollbacks}, lines)
    return 1 if any(r["status"] == "BAD" for r in rows) else 0


def _pick(args, mgr):
    from .format import CheckpointError

    if args.epoch is not None:
        return mgr.path_of(args.epoch)
    versions = mgr.list()
    if not versions:
        raise CheckpointError("no checkpoint versions in this directory", mgr.directory)
    return versions[-1].path


def _ckpt_inspect(args) -> int:
    from .format import CheckpointError
    from .manager import header_of
    from .versions import CheckpointVersions

    mgr = CheckpointVersions(args.dir)
    try:
        h = header_of(_pick(args, mgr))
    except CheckpointError as exc:
        return _fail(args, exc)
    summary = h.summary()
    summary["groups"] = h.groups
    summary["datasets_list"] = [e.as_json() for e in h.entries]
    lines = [f"{h.path}"]
    for k, v in h.attrs.items():
        lines.append(f"  {k:<18} {v}")
    lines.append(f"  {'data':<18} {summary['datasets']} datasets, {_fmt_bytes(summary['data_bytes'])}")
    for sec, s in summary["sections"].items():
        lines.append(f"    /{sec:<15} {s['datasets']:>6} datasets  {_fmt_bytes(s['bytes']):>10}")
    for g, attrs in h.groups.items():
        for k, v in attrs.items():
            text = json.dumps(v)
            lines.append(f"  attr {g}/{k} = {text[:200]}{'...' if len(text) > 200 else ''}")
    if args.datasets:
        for e in h.entries:
            lines.append(f"  {e.path:<60} {e.dtype:<9} {str(list(e.shape)):<20} {_fmt_bytes(e.nbytes):>10}  "
                         f"sha256 {e.sha256[:16]}...")
    _emit(args, summary, lines)
    return 0


def _fail(args, exc) -> int:
    if args.json:
        print(json.dumps({"ok": False, "error": str(exc), "problems": getattr(exc, "problems", [])}, indent=2))
    else:
        print(printable(f"error: {exc}"), file=sys.stderr)
    return 1


def _ckpt_verify(args) -> int:
    from .format import CheckpointError
    from .inspect import verify_file
    from .versions import CheckpointVersions

    mgr = CheckpointVersions(args.dir)
    paths = [mgr.path_of(args.epoch)] if args.epoch is not None else [v.path for v in mgr.list()]
    results = []
    for p in paths:
        try:
            h = verify_file(p)
            results.append({"path": str(p), "epoch": h.epoch, "ok": True, "datasets": len(h.entries)})
        except CheckpointError as exc:
            results.append({"path": str(p), "ok": False, "error": str(exc), "problems": exc.problems})
    lines = [f"{'OK ' if r['ok'] else 'BAD'} {r['path']}"
             + (f" ({r['datasets']} datasets, all SHA-256 match)" if r["ok"] else f"\n    {r['error']}")
             for r in results]
    if not results:
        lines = [f"{args.dir}: no checkpoint versions"]
    good = sum(r["ok"] for r in results)
    lines.append(f"{good} of {len(results)} verified")
    _emit(args, {"directory": str(args.dir), "results": results, "ok": good == len(results) and bool(results)}, lines)
    return 0 if results and good == len(results) else 1


def _ckpt_rollback(args) -> int:
    from .format import CheckpointError
    from .versions import CheckpointVersions

    mgr = CheckpointVersions(args.dir)
    if (args.epoch is None) == (not args.undo):
        print("hvps ckpt rollback: give either --to EPOCH or --undo (not both)", file=sys.stderr)
        return 2
    try:
        if args.undo:
            moved = mgr.undo_rollback(force=args.force)
            action = "restored from the attic"
        else:
            moved = mgr.rollback(args.epoch)
            action = f"moved to the attic; epoch {args.epoch} is now the newest version"
    except CheckpointError as exc:
        return _fail(args, exc)
    lines = [f"{len(moved)} version(s) {action}"] + [f"  {p}" for p in moved]
    _emit(args, {"ok": True, "undo": bool(args.undo), "epoch": args.epoch, "moved": [str(p) for p in moved]}, lines)
    return 0


def register(sub) -> None:
    """Add ``hvps ckpt`` and its verbs to the ``hvps`` command's subparsers."""
    p = sub.add_parser("ckpt", help="inspect, verify and roll back HDF5 checkpoint directories",
                       description="Work with a directory of hvps checkpoints (ckpt-epoch-NNNNNN.h5).")
    csub = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    csub.required = True

    def common(q):
        q.add_argument("dir", metavar="DIR", help="checkpoint directory")
        q.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")

    q = csub.add_parser("list", help="list versions (exit status 1 if any is unreadable)",
                        description="List the versions in DIR with epoch, step, size, world size and creation time.")
    common(q)
    q.add_argument("--verify", action="store_true",
                   help="also check every dataset's SHA-256 (reads all data; default: headers only)")
    q.set_defaults(func=_ckpt_list)

    q = csub.add_parser("inspect", help="show one version's attributes and contents",
                        description="Show root attributes, sections and JSON attributes of one version "
                                    "(the newest unless --epoch). Reads no tensor data.")
    common(q)
    q.add_argument("--epoch", type=int, metavar="N", help="the version to show (default: the newest)")
    q.add_argument("--datasets", action="store_true", help="also list every dataset with dtype, shape and digest")
    q.set_defaults(func=_ckpt_inspect)

    q = csub.add_parser("verify", help="verify checksums (exit status 1 if anything is bad)",
                        description="Verify structure, manifest and the SHA-256 of every dataset of every "
                                    "version in DIR (or of one with --epoch).")
    common(q)
    q.add_argument("--epoch", type=int, metavar="N", help="verify only this version")
    q.set_defaults(func=_ckpt_verify)

    q = csub.add_parser("rollback", help="make an earlier version the newest, or undo that",
                        description="--to N moves every version newer than N into DIR/attic/ (nothing is "
                                    "deleted); --undo moves the most recent rollback back.")
    common(q)
    q.add_argument("--to", dest="epoch", type=int, metavar="N", help="epoch that becomes the newest version")
    q.add_argument("--undo", action="store_true", help="restore the versions moved away by the last rollback")
    q.add_argument("--force", action="store_true",
                   help="with --undo: if versions with the same epochs were written since, move those to the "
                        "attic first instead of refusing")
    q.set_defaults(func=_ckpt_rollback)
