"""SLOs given on the command line, e.g. `--slo errors<=0 --slo detect_s<=4 --slo reprefill_ratio<=1.2`."""

from __future__ import annotations

import dataclasses
import operator
import re

OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt, "==": operator.eq}
PATTERN = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=|==|<|>)\s*([-+0-9.eE]+)\s*$")


@dataclasses.dataclass
class Slo:
    metric: str
    op: str
    bound: float

    def check(self, summary: dict) -> dict:
        value = summary.get(self.metric)
        passed = value is not None and OPS[self.op](value, self.bound)
        return {"slo": f"{self.metric}{self.op}{self.bound:g}", "value": value, "passed": passed}


def parse_slo(text: str, known: set[str]) -> Slo:
    match = PATTERN.match(text)
    if not match:
        raise ValueError(f"bad SLO {text!r}: write METRIC<=VALUE (or >=, <, >, ==)")
    metric, op, bound = match.groups()
    if metric not in known:
        raise ValueError(f"unknown SLO metric {metric!r}; known: {', '.join(sorted(known))}")
    return Slo(metric, op, float(bound))
