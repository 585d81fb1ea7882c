"""The GPU battery's summary: one JSON file and a short Markdown rendering of it, in $OUT.

tools/gpu/battery.sh calls this after every step, so the summary on disk always holds what has run so
far, even when a part is stopped from outside:

    python tools/gpu/summary.py begin --out DIR --part 1 --device cuda --budget 540
    python tools/gpu/summary.py step  --out DIR --part 1 --name parity --rc 0 --seconds 41 \\
        --log DIR/parity.log --result DIR/parity.json
    python tools/gpu/summary.py step  --out DIR --part 1 --name tests --skipped "needs a GPU"
    python tools/gpu/summary.py end   --out DIR --part 1     # exit 0 only when the part is ok

summary.json: {"parts": {"1": {"device", "started", "budget_s", "wall_s", "status", "steps": {name:
{"status", "rc", "seconds", "log", "reason", "result"}}}, "2": ...}}. A step's status is "ok" (exit 0),
"failed", "timed out" (exit 124 or 137: `timeout` stopped it), "incomplete" (it stopped itself at its
deadline: the report's "incomplete" names what did not finish; or a baseline or peer of a target's ratio
failed: its "unmeasured"), "skipped" (with the reason: by design,
e.g. `pytest -m cuda` on the stand-in) or "not run" (the part's time was spent). A part is "ok" when
every step is ok or skipped, "incomplete" when some did not run or were cut off, "failed" otherwise.
Parts of earlier runs into the same $OUT are kept. summary.md renders it: the steps, then the parity
layouts, the throughput rows, the scale search and every skip with its reason.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import time
from pathlib import Path

__all__ = ["load", "save", "render", "main"]

TIMED_OUT = (124, 137)


def load(out: Path) -> dict:
    path = out / "summary.json"
    if path.exists():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            pass  # a summary cut off mid-write by an earlier run: start again
    return {"battery": "capstan GPU battery (tools/gpu/battery.sh, docs/gpu.md)", "parts": {}}


def save(out: Path, summary: dict) -> None:
    summary["updated"] = _now()
    for name, text in (("summary.json", json.dumps(summary, indent=1)), ("summary.md", render(summary))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _status(steps: dict) -> str:
    states = {s["status"] for s in steps.values()}
    if states <= {"ok", "skipped"}:
        return "ok"
    if "failed" in states:
        return "failed"
    return "incomplete"


# ---- rendering ----------------------------------------------------------------------------------------
def _fmt(x, spec: str = ".3g") -> str:
    return "n/a" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def _rows(title: str, rows: dict) -> list[str]:
    lines = [f"**{title}**", "", "| system | ms/step | tokens/s | TFLOPS | MFU | peak device GiB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        if "step_s" in r:
            lines.append(f"| {name} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | {r['tflops']:.3g} | "
                         f"{_fmt(r.get('mfu'), '.2f')} | {r['peak_device'] / 2**30:.2f} |")
        else:
            why = "skipped: " + r["skipped"] if "skipped" in r else "error: " + str(r.get("error"))
            lines.append(f"| {name} | {why} | | | | |")
    return lines + [""]


def _result(name: str, result: dict) -> list[str]:
    lines: list[str] = []
    if "layouts" in result:  # the parity report
        verdict = "ok" if result.get("ok") else "FAILED" if result.get("failed", True) else "incomplete"
        lines += [f"**Parity on {result['device']}**: {verdict}, {result['steps']} "
                  f"steps, losses within {result['tol_loss']:.0e} relative, norms within {result['tol_norm']:.0e}"
                  + (f", two ranks' transport {result['transport']}" if result.get("transport") else ""), "",
                  "| layout | max rel. loss diff | max rel. norm diff | verdict |", "| --- | --- | --- | --- |"]
        for layout, r in result["layouts"].items():
            lines.append(f"| {layout} | {_fmt(r.get('max_rel_loss'), '.1e')} | {_fmt(r.get('max_rel_norm'), '.1e')} | "
                         f"{'ok' if r['ok'] else 'FAIL: ' + '; '.join(r['problems'])} |")
        lines += [""] + [f"- {label}: {error[:300]}" for label, error in result.get("errors", {}).items()]
        lines += [f"- cut short: {what}" for what in result.get("incomplete", [])] + [""]
    for section in ("speed", "peers"):
        if section in result:
            lines += _rows(f"{section} ({result['device']})", result[section])
    if "scale" in result:
        sc = result["scale"]
        lines += [f"**Largest GPT that trains a step** (d_model {sc['d_model']}, {result['device']})", "",
                  "| system | layers | parameters | search ended | fails at | non-memory failures |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for system, r in sc["systems"].items():
            end = r["end"] + (" (an earlier call)" if r.get("earlier") else "") + (
                f" (from {r['known']} layers known to fit in an earlier lease)" if r.get("known") else "")
            lines.append(f"| {system} | {r['layers']} | {r['params'] / 1e9:.3f}B | {end} | "
                         f"{_fmt(r['fails_at'])} | {r.get('not_memory') or ''} |")
        lines.append("")
    ratios = {k: v for k, v in result.get("ratios", {}).items() if v is not None}
    lines += [f"- {k}: {v:.2f}x" for k, v in ratios.items()]
    missing = [f"- not measured: {u[:300]}" for u in result.get("unmeasured", [])]
    return lines + missing + ([""] if ratios or missing else [])


def render(summary: dict) -> str:
    lines = ["# capstan GPU battery", "",
             "Written by tools/gpu/battery.sh (docs/gpu.md); summary.json has every figure.", ""]
    for part, p in sorted(summary["parts"].items()):
        lines += [f"## Part {part} on {p['device']}: {p['status']}",
                  "", f"git {p.get('git')}, started {p.get('started')}, {p.get('host')}; "
                      f"{_fmt(p.get('wall_s'), '.0f')} s of a {_fmt(p.get('budget_s'), '.0f')} s budget", "",
                  "| step | status | seconds | note |", "| --- | --- | --- | --- |"]
        for name, s in p["steps"].items():
            lines.append(f"| {name} | {s['status']} | {_fmt(s.get('seconds'), '.0f')} | {s.get('reason') or ''} |")
        lines.append("")
        for name, s in p["steps"].items():
            if isinstance(s.get("result"), dict):
                lines += _result(name, s["result"])
        skipped = {k: v for s in p["steps"].values() if isinstance(s.get("result"), dict)
                   for k, v in s["result"].get("skipped", {}).items()}
        skipped.update({name: s["reason"] for name, s in p["steps"].items() if s["status"] == "skipped"})
        if skipped:
            lines += ["**Skipped**", ""] + [f"- {k}: {v}" for k, v in skipped.items()] + [""]
    return "\n".join(lines)


# ---- commands -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("begin", "step", "end"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--part", required=True)
    ap.add_argument("--device")
    ap.add_argument("--budget", type=float)
    ap.add_argument("--name")
    ap.add_argument("--rc", type=int)
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--log")
    ap.add_argument("--result", help="the step's JSON report (kept in the summary)")
    ap.add_argument("--skipped", help="the step did not run, for this reason")
    ap.add_argument("--not-run", help="the step did not run: the part's time was spent")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = load(args.out)
    if args.command == "begin":
        summary["parts"][args.part] = {"device": args.device, "started": _now(), "t0": time.time(),
                                       "budget_s": args.budget, "git": _git(), "status": "running",
                                       "host": f"{platform.node()}, {os.cpu_count()} cores, Python "
                                               f"{platform.python_version()}", "steps": {}}
    else:
        part = summary["parts"].setdefault(args.part, {"device": args.device, "status": "running", "steps": {}})
        if args.command == "step":
            step: dict = {"seconds": args.seconds, "rc": args.rc, "log": args.log}
            if args.skipped or args.not_run:
                step.update(status="skipped" if args.skipped else "not run", reason=args.skipped or args.not_run)
            else:
                step["status"] = "ok" if args.rc == 0 else "timed out" if args.rc in TIMED_OUT else "failed"
                if step["status"] == "timed out":
                    step["reason"] = "stopped at its time limit: the part's budget"
            if args.result and Path(args.result).exists():
                try:
                    step["result"] = json.loads(Path(args.result).read_text())
                except json.JSONDecodeError as exc:
                    step["result_error"] = f"{args.result}: {exc}"
            result = step.get("result") if isinstance(step.get("result"), dict) else {}
            incomplete, unmeasured = result.get("incomplete"), result.get("unmeasured")
            if step["status"] == "ok" and incomplete:
                step.update(status="incomplete", reason="cut short by the deadline: " + ", ".join(incomplete))
            elif step["status"] == "ok" and unmeasured:  # a target's baseline or peer failed: its ratio is missing
                step.update(status="incomplete", reason="not measured: " + "; ".join(u[:200] for u in unmeasured))
            part["steps"][args.name] = step
        part["wall_s"] = round(time.time() - part.get("t0", time.time()), 1)
        part["status"] = _status(part["steps"]) if args.command == "end" else "running"
    save(args.out, summary)
    if args.command == "end":  # the part's exit status: 0 only when it is ok
        return 0 if summary["parts"][args.part]["status"] == "ok" else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
