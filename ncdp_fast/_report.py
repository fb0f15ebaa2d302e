"""Reports shared by the benchmarks (bench/) and the reproductions
(``ncdp-fast reproduce``): the machine, the commit, and JSON + Markdown tables
written to ``bench/results/``."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path

import numpy as np

# The source checkout (bench/ and bench/results/ live next to the package).
ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    try:
        sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                      stderr=subprocess.DEVNULL, text=True).strip()
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD", "--", "ncdp_fast", "csrc",
                                 "bench"], cwd=ROOT, stderr=subprocess.DEVNULL)
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "uncommitted"


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(torch_mod=None) -> dict:
    import numba
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "numba_threads": numba.get_num_threads(),
            "python": platform.python_version(), "numpy": np.__version__,
            "numba": numba.__version__}
    if torch_mod is not None:
        info["torch"] = torch_mod.__version__
        info["torch_threads"] = torch_mod.get_num_threads()
        if torch_mod.cuda.is_available():
            info["gpu"] = torch_mod.cuda.get_device_name()
    try:
        import opacus
        info["opacus"] = opacus.__version__
    except ImportError:
        pass
    return info


def _write_whole(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or keeps what it held: written beside it,
    then renamed over it (a tool that rewrites its report as it goes may be
    killed at a deadline, gpu-check's, and the report is then read)."""
    part = path.with_name(f".{path.name}.part")
    part.write_text(text)
    os.replace(part, path)


def write_report(name: str, out_dir: str, meta: dict, rows: list[dict], columns: list[tuple],
                 notes: list[str] = (), quiet: bool = False, md_rows: list[dict] | None = None
                 ) -> Path:
    """Write ``<name>-<device>-<date>.json`` and ``.md`` (a table of ``columns``:
    (key, header, format), of ``md_rows`` where given, else of every row) and
    return the JSON path.  ``meta``'s own "date" and "commit" (those of the
    measurement) win over now's."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc)
    meta = dict(dict(date=now.strftime("%Y-%m-%d %H:%M UTC"), commit=git_commit()), **meta)
    device = meta.get("device_tag", "cpu")
    stem = f"{name}-{device}-{now.strftime('%Y%m%d')}"
    _write_whole(out / f"{stem}.json", json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"# {name}", "",
             f"- device: {meta.get('device', '?')}",
             f"- commit: {meta['commit']}",
             f"- date: {meta['date']}", ""]
    for n in notes:
        lines.append(f"- {n}")
    if notes:
        lines.append("")
    lines.append("| " + " | ".join(h for _, h, _ in columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for r in rows if md_rows is None else md_rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("" if v is None else (fmt.format(v) if fmt else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    _write_whole(out / f"{stem}.md", "\n".join(lines) + "\n")
    if not quiet:
        print("\n".join(lines))
    return out / f"{stem}.json"


def save_figure(fig, name: str, out_dir: str, device: str = "cpu") -> Path:
    """Save a matplotlib figure as ``<name>-<device>-<date>.png`` next to the
    tables of the same run, and close it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{device}-{_dt.datetime.now(_dt.timezone.utc).strftime('%Y%m%d')}"
    path = out / f"{stem}.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path
