"""The run's report written into its output (report.json, report.md, the PNGs), from what is committed."""

from __future__ import annotations

from tokenmill_runner.report.files import REPORT_DIR, write_report
from tokenmill_runner.store.storage import Storage

from ..decide.status import ReportStatus


def write_report_status(storage: Storage) -> ReportStatus:
    """Write the report's files from what is committed, and say where they are and what they found."""
    report, _ = write_report(storage)
    findings = [f["message"] for f in report["findings"] if f["level"] != "pass"]
    return ReportStatus(uri=storage.uri(f"{REPORT_DIR}/report.json"), verdict=report["verdict"], findings=findings)
