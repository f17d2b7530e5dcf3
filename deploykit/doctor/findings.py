"""What doctor found: one `Finding` per question a person asks ("are the NUMA calls allowed?"), grouped in
sections, each with a level, the evidence behind it, the likely cause and the fix (a command or a spec change)."""

from __future__ import annotations

from dataclasses import dataclass, field

OK, INFO, WARN, FAIL = "ok", "info", "warn", "fail"
LEVELS = (OK, INFO, WARN, FAIL)  # in increasing severity
SYMBOLS = {OK: "✔", INFO: "ℹ", WARN: "⚠", FAIL: "✖"}


@dataclass(frozen=True, slots=True)
class Finding:
    id: str  # stable key for scripts and tests, e.g. "numa.syscalls"
    level: str  # ok | info | warn | fail; fail means inference is slowed or broken and makes the exit code non-zero
    title: str  # the answer in one line, the way a person asks the question
    evidence: tuple[str, ...] = ()  # what was measured or read, with the file or field it came from
    cause: str = ""  # the likely cause, when the evidence points at one
    fix: tuple[str, ...] = ()  # commands or spec changes, best first

    def to_dict(self) -> dict:
        return {"id": self.id, "level": self.level, "title": self.title, "evidence": list(self.evidence),
                "cause": self.cause, "fix": list(self.fix)}


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    findings: tuple[Finding, ...]


@dataclass(frozen=True, slots=True)
class Report:
    target: str  # what was examined, e.g. "this host", "pid 4242 (vllm serve ...)"
    sections: tuple[Section, ...]
    data: dict = field(default_factory=dict, compare=False)  # raw measurements for --format json

    @property
    def findings(self) -> tuple[Finding, ...]:
        return tuple(f for s in self.sections for f in s.findings)

    def count(self, level: str) -> int:
        return sum(f.level == level for f in self.findings)

    @property
    def critical(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.level == FAIL)

    def find(self, finding_id: str) -> Finding | None:
        return next((f for f in self.findings if f.id == finding_id), None)

    def to_dict(self) -> dict:
        return {"target": self.target,
                "summary": {level: self.count(level) for level in LEVELS},
                "sections": [{"name": s.name, "findings": [f.to_dict() for f in s.findings]} for s in self.sections],
                **({"data": self.data} if self.data else {})}
