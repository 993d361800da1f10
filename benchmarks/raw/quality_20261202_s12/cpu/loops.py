"""Recount the loops of this record's CPU eval reports with flashdraft's own accounting.

    PYTHONPATH=. python benchmarks/raw/quality_20261202_s12/cpu/loops.py
"""

import json
from pathlib import Path

from flashdraft.data.loops import loop_start
from flashdraft.eval.report import steps_before
from flashdraft.eval.speculative import DecodeResult

HERE = Path(__file__).parent
for kind in ("chat", "humaneval", "code"):
    for run in ("ref6", "m6"):
        report = json.loads((HERE / f"{run}_{kind}.json").read_text())
        loops, kept = 0, []
        for p in report["per_prompt"]:
            result = DecodeResult(p["output_ids"], p["acceptance_lengths"], 0, 0.0, 0.0, False)
            start = loop_start(p["output_ids"])
            loops += start is not None
            kept += steps_before(result, start)
        print(f"{kind} {run}: tau {report['tau']:.3f}; {loops}/24 end in a loop; "
              f"tau before the loops {sum(kept) / len(kept):.3f} over {len(kept)} steps")
