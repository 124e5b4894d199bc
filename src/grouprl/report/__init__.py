"""`grouprl report OUTPUT_DIR`: one self-contained HTML page about a training run.

Reads what a run leaves in its output directory: ``metrics.jsonl`` (one JSON object per log
entry under TRL's metric names; evaluation entries carry ``eval_*`` keys and the last entry
``train_runtime``) and, when ``log_completions`` was on, ``completions/completions_*.parquet``.
Writes ``OUTPUT_DIR/report/index.html``: a summary, the health findings (the detectors of
`grouprl.train.health` run over each log entry), the charts and a sample of completions. Each chart is
embedded as a base64 PNG, so the page needs no other file and no network, and is also written as
``OUTPUT_DIR/report/<chart>.png``. A chart whose metrics the run did not log says so instead.

Modules: `run_log.py` reads the run, `charts.py` draws the charts, `sections.py` writes the page's
summary, health and completion sections, and `writer.py` assembles and writes the page
(`write_report`, also ``grouprl.write_report``).
"""
