"""Merge per-rank results into one report, and print it as a table or JSON."""
from __future__ import annotations

import json
from typing import Optional

from .base import REGISTRY, VERDICTS, worst

WIDTH_NAME, WIDTH_VERDICT = 18, 7


def _ranks(ranks: list) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _differences(rows: list) -> Optional[str]:
    """For a check that must agree everywhere: what differs and on which ranks, or None."""
    datas = [r["data"] for r in rows]
    if all(datas):
        keys = sorted({k for d in datas for k in d})
        parts = []
        for k in keys:
            groups: dict = {}
            for r in rows:
                groups.setdefault(str(r["data"].get(k)), []).append(r["rank"])
            if len(groups) > 1:
                parts.append(f"{k}: " + "; ".join(f"{v} on {_ranks(rs)}" for v, rs in groups.items()))
        return " | ".join(parts) or None
    groups = {}
    for r in rows:
        groups.setdefault(r["value"], []).append(r["rank"])
    return None if len(groups) < 2 else " | ".join(f"{v} on {_ranks(rs)}" for v, rs in groups.items())


def merge(per_rank: list) -> dict:
    """``per_rank``: ``[{"rank", "host", "checks": [Check.as_json()]}]`` -> the report dict."""
    per_rank = sorted(per_rank, key=lambda r: r["rank"])
    names = [c["name"] for c in per_rank[0]["checks"]]
    checks = []
    for name in names:
        rows = [dict(c, rank=r["rank"], host=r["host"]) for r in per_rank for c in r["checks"] if c["name"] == name]
        first = rows[0]
        merged = {k: first[k] for k in ("name", "verdict", "value", "why", "fix", "data")}
        merged["verdict"] = worst(r["verdict"] for r in rows)
        if len(rows) > 1:
            merged["per_rank"] = [{k: r[k] for k in ("rank", "host", "verdict", "value")} for r in rows]
            spec = REGISTRY.get(name)
            diff = _differences(rows) if spec and spec.mismatch else None
            values = {r["value"] for r in rows}
            if diff:
                merged.update(verdict=worst([merged["verdict"], spec.mismatch]), value=f"MISMATCH {diff}",
                              why=first["why"] + "; it differs across ranks",
                              fix="install the same versions and settings on every node (one image or environment)")
            elif len(values) == 1:
                merged["value"] = f"{first['value']} (all {len(rows)} ranks)"
            else:
                merged["value"] = " | ".join(f"{_ranks([r['rank']])} ({r['host']}): {r['value']}" for r in rows)
            bad = next((r for r in rows if r["verdict"] == merged["verdict"]), first)
            if not diff:
                merged["fix"], merged["why"] = bad["fix"], bad["why"]
        checks.append(merged)
    summary = {v: sum(c["verdict"] == v for c in checks) for v in VERDICTS}
    return {"hvps_doctor": 1, "ranks": len(per_rank), "hosts": sorted({r["host"] for r in per_rank}),
            "context": per_rank[0].get("context", {}), "summary": summary, "checks": checks,
            "exit_status": exit_status(checks)}


def exit_status(checks: list) -> int:
    """1 when any check failed, else 0 (warnings and skips do not change it)."""
    return 1 if any(c["verdict"] == "fail" for c in checks) else 0


def as_json(report: dict) -> str:
    return json.dumps(report, indent=2, default=str)


def as_table(report: dict, verbose: bool = False) -> str:
    ctx = report.get("context", {})
    lines = [f"hvps doctor: {report['ranks']} rank(s) on {', '.join(report['hosts'])}; "
             f"{ctx.get('ranks_per_node', 1)} rank(s) per node; container: {ctx.get('container') or 'none'}",
             f"{'CHECK':<{WIDTH_NAME}} {'VERDICT':<{WIDTH_VERDICT}} VALUE"]
    for c in report["checks"]:
        lines.append(f"{c['name']:<{WIDTH_NAME}} {c['verdict'].upper() if c['verdict'] == 'fail' else c['verdict']:<{WIDTH_VERDICT}} "
                     f"{c['value']}")
        if verbose or c["verdict"] in ("warn", "fail"):
            lines.append(f"{'':<{WIDTH_NAME}}   why: {c['why']}")
        if c["fix"] and c["verdict"] in ("warn", "fail"):
            lines.append(f"{'':<{WIDTH_NAME}}   fix: {c['fix']}")
    s = report["summary"]
    lines.append(f"summary: {s['ok']} ok, {s['warn']} warn, {s['fail']} fail, {s['skip']} skip "
                 f"(exit status {report['exit_status']})")
    return "\n".join(lines)
