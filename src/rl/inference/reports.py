"""The reports of a server's vLLM workers (one per tensor-parallel rank) on a load or a check, made one."""

from __future__ import annotations


def merge_reports(reports: list[dict]) -> dict:
    """One report from every worker's (one per tensor-parallel rank): ok only if all are and all verified the same
    files' checksum; the problems of every worker, each named by its rank where there are several."""
    first = dict(reports[0])
    first["ok"] = all(r["ok"] for r in reports)
    first["reloaded"] = any(r.get("reloaded", False) for r in reports)
    if len(reports) > 1:
        for key in ("mismatched", "differing"):
            first[key] = [f"worker {r.get('tp_rank', i)}: {p}" for i, r in enumerate(reports) for p in r.get(key, [])]
        if first["ok"] and len({r.get("checksum") for r in reports}) != 1:
            first["ok"] = False
            first["differing"] = ["the workers verified different files: checksums " +
                                  ", ".join(str(r.get("checksum")) for r in reports)]
        first["corrupt"] = next((r["corrupt"] for r in reports if r.get("corrupt")), None)
        if all("device_bytes" in r for r in reports):  # what the worker that copied the most copied
            first["device_bytes"] = max(r["device_bytes"] for r in reports)
    return first



def why(report: dict) -> str:
    problems = report.get("mismatched", []) + report.get("differing", [])
    return "; ".join(problems[:5]) or "no reason reported"



def timings(report: dict) -> dict:
    keys = ("files_s", "reload_s", "verify_s", "bytes_read", "device_bytes")
    return {k: report[k] for k in keys if k in report}
