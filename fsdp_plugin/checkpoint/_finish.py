"""The end of every load (our format and DCP alike): copy staged values into place, run the optimizer finishers,
and report what a non-strict load skipped."""
from __future__ import annotations

import warnings

from .._flat.offload import before_any_host_write
from .errors import CheckpointMismatchWarning, MismatchReport


def finish_load(path: str, copy_back: list, finishers: list, report: MismatchReport, out_report) -> None:
    if copy_back:
        before_any_host_write()     # cpu_offload: no host-to-device copy still reads a master written here
    for dst, src in copy_back:
        dst.copy_(src)
    for fin in finishers:
        fin()
    if report:
        warnings.warn(CheckpointMismatchWarning(f"load_checkpoint({path}) skipped: {report.describe()}", report))
        if out_report is not None:
            out_report.extend(report)
