"""What a run measured, per backend x dtype x op: examples, error distribution, the worst case, the outcome."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class OpRecord:
    backend: str
    dtype: str
    op: str
    examples: int = 0
    budget: float = 0.0  # the budget of the worst example, in ULPs at the scale
    worst_ulps: float = 0.0
    worst_case: dict | None = None
    worst_command: str = ""
    per_example: list[float] = field(default_factory=list)  # each example's largest error in ULPs
    outcome: str = "not run"  # passed, failed, unsupported, errored
    message: str = ""

    def add(self, ulps: float, budget: float, case: dict, command: str) -> None:
        self.examples += 1
        self.per_example.append(ulps)
        if self.worst_case is None or ulps / budget > self.worst_ulps / self.budget:
            self.worst_ulps, self.budget, self.worst_case, self.worst_command = ulps, budget, case, command

    @property
    def headroom(self) -> float:
        """Budget over the worst error: above 1 passes; how much room is left."""
        return self.budget / self.worst_ulps if self.worst_ulps else float("inf")

    def quantile(self, q: float) -> float:
        return float(np.quantile(self.per_example, q)) if self.per_example else 0.0


class Recorder:
    def __init__(self):
        self.records: dict[tuple[str, str, str], OpRecord] = {}
        self.forward: dict[tuple[str, str], object] = {}  # (backend, dtype) -> forward.ForwardVerdict

    def __call__(self, backend: str, dtype: str, op: str) -> OpRecord:
        key = (backend, dtype, op)
        if key not in self.records:
            self.records[key] = OpRecord(backend, dtype, op)
        return self.records[key]

    def table(self) -> list[str]:
        """The terminal summary: one line per backend x dtype x op."""
        lines = [f"{'backend':<8} {'dtype':<9} {'op':<15} {'outcome':<11} {'examples':>8} "
                 f"{'max ULPs':>10} {'budget':>9} {'headroom':>9}"]
        for r in sorted(self.records.values(), key=lambda r: (r.backend, r.dtype, r.op)):
            lines.append(f"{r.backend:<8} {r.dtype:<9} {r.op:<15} {r.outcome:<11} {r.examples:>8} "
                         f"{r.worst_ulps:>10.3g} {r.budget:>9.3g} {r.headroom:>9.3g}")
        for (backend, dtype), v in sorted(self.forward.items()):
            worst = max(v.layers, key=lambda e: e[0] / max(e[1], 1e-300), default=(0.0, 0.0))
            lines.append(f"{backend:<8} {dtype:<9} {'forward':<15} {'failed' if v.failures else 'passed':<11} "
                         f"logits rel. error {v.logits[0]:.3g} (baseline {v.logits[1]:.3g}), worst layer "
                         f"{worst[0]:.3g} (baseline {worst[1]:.3g}), top-1 agreement {v.top1_agreement:.0%}")
        return lines
