"""The trajectory viewer: `grpokit view OUTPUT_DIR` writes one self-contained report.html of a run (curves,
completions by step and group, per-token colouring); ``--serve`` serves it live while the run writes, from
grpokit/server/viewer_site.py (on the transport every grpokit server has). Standard library only (no torch);
docs/viewer.md."""

from grpokit.viewer.report import REPORT_NAME, render_html, report_data, write_report

__all__ = ["REPORT_NAME", "render_html", "report_data", "write_report"]
