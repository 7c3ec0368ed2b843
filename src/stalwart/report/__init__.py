"""The offline run report: ``stalwart report`` and the chaos campaign's report.

It reads what a run left in its run directory (`stalwart.observability.run_dir` names the
artefacts) and writes one self-contained HTML page; nothing here runs during training.

* `run_report`: ``load_run`` (every artefact, hostile files read as far as they are valid) and
  ``write_report`` (``report.html`` + PNGs when matplotlib exists).
* `compare`: ``write_comparison``, two or more runs overlaid (``stalwart report runA runB``).
* `html` renders a loaded run; its charts come from `plotly_charts` (interactive, when plotly is
  installed) or `svg` (inline, static); `goodput` is the ledger's section, `config` the settings
  of ``run.json``; `clean` is the one reader of JSON and JSONL artefacts.
"""

from stalwart.report.compare import write_comparison
from stalwart.report.run_report import load_run, write_report

__all__ = ["load_run", "write_comparison", "write_report"]
