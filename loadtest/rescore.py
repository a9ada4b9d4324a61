"""Judge a finished run again against other targets, without re-running it.

    python -m embedserve.loadtest.rescore results/soak-cpu-2h --max-error-rate 0.001 \\
        --max-p95-drift 0.5 --max-memory-growth-mib 100 --memory-series 'engine|gateway|pid'

Rewrites the folder's results.json verdict and summary.md (and the plots, from the saved
figures). The previous verdict is kept under ``verdict_history``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from embedserve.loadtest import plots, report
from embedserve.loadtest.args import add_target_args, targets_from
from embedserve.loadtest.verdict import evaluate, verdict_label


def main(argv: list[str] | None = None) -> int:
    """0 when the new verdict passes, 1 when it fails, 2 when the folder has no results."""
    ap = argparse.ArgumentParser(prog="python -m embedserve.loadtest.rescore", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="a results folder (holding results.json)")
    ap.add_argument("--no-plots", action="store_true")
    add_target_args(ap)
    a = ap.parse_args(argv)
    path = a.folder / "results.json"
    if not path.is_file():
        print(f"no results.json in {a.folder}", file=sys.stderr)
        return 2
    res = json.loads(path.read_text())
    res.setdefault("verdict_history", []).append(res["verdict"])
    growths = res["memory"]["growth_after_warmup"]
    res["verdict"] = evaluate(targets_from(a), res["measured"], res["windows"], growths)
    names = [] if a.no_plots else plots.write_all(res, a.folder)
    report.write(res, a.folder, names)
    print(f"{verdict_label(res['verdict'])}: {a.folder / 'summary.md'}",
          file=sys.stderr)
    return 0 if res["verdict"]["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
