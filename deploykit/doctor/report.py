"""A doctor Report as text (✔ / ℹ / ⚠ / ✖ lines; each problem with its evidence, cause and fix) or JSON.

Plain text on purpose (no rich/colour library): the report is pasted into issues and CI logs, where escape codes
and box drawing get in the way.
"""

from __future__ import annotations

import json
import textwrap

from .findings import FAIL, INFO, OK, SYMBOLS, WARN, Report

WIDTH = 118


def text(report: Report, verbose: bool = False) -> str:
    """Problems show their evidence, cause and fix; ✔ lines show evidence only with `verbose`."""
    out = [f"deploykit doctor: {report.target}", ""]
    for section in report.sections:
        out.append(section.name)
        for f in section.findings:
            out += _wrap(f"  {SYMBOLS[f.level]} ", f.title)
            detail = f.level in (WARN, FAIL) or verbose
            if detail or (f.level == INFO and f.fix):
                for e in f.evidence:
                    out += _wrap("      ", e)
                if f.cause:
                    out += _wrap("      cause: ", f.cause)
                for i, fix in enumerate(f.fix):
                    out += _wrap("      fix: " if i == 0 else "           ", fix)
        out.append("")
    counts = ", ".join(f"{report.count(level)} {SYMBOLS[level]}" for level in (OK, INFO, WARN, FAIL))
    verdict = (f"{len(report.critical)} critical problem(s) (✖): apply the fixes above" if report.critical
               else "nothing critical")
    out.append(f"{counts}: {verdict}")
    return "\n".join(out) + "\n"


def as_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, sort_keys=False, ensure_ascii=False) + "\n"


def _wrap(prefix: str, body: str) -> list[str]:
    return textwrap.wrap(body, WIDTH, initial_indent=prefix, subsequent_indent=" " * len(prefix),
                         break_on_hyphens=False, break_long_words=False) or [prefix.rstrip()]
