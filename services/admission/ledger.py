"""Per-class budgets in integer cost units: what each class may have in flight and what it holds now.

Costs are whole units (GPU-ms rounded up) so that releasing a ticket returns exactly what admitting it
took, with no floating-point residue accumulating over millions of tickets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

REQUEST_CLASSES = ("SHORT", "MEDIUM", "LONG", "FAILOVER", "ROLLOUT")


@dataclass
class ClassAccount:
    budget: int
    in_use: int = 0

    @property
    def free(self) -> int:
        # Negative after a live budget cut below what is in flight; nothing is admitted until it recovers.
        return self.budget - self.in_use


def check_budgets(budgets: Mapping[str, int]) -> dict[str, int]:
    unknown = set(budgets) - set(REQUEST_CLASSES)
    if unknown:
        raise ValueError(f"budgets: unknown request class(es) {sorted(unknown)}; known: {REQUEST_CLASSES}")
    for cls, value in budgets.items():
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"budgets: {cls} budget {value!r} must be a non-negative integer")
    return dict(budgets)


class BudgetLedger:
    """Independent accounts: one class's traffic never touches another class's budget."""

    def __init__(self, budgets: Mapping[str, int]):
        self.accounts = {cls: ClassAccount(budget) for cls, budget in check_budgets(budgets).items()}

    def account(self, cls: str) -> ClassAccount:
        try:
            return self.accounts[cls]
        except KeyError:
            raise ValueError(f"request_class: no budget for class {cls!r}") from None

    def fits(self, cls: str, cost: int) -> bool:
        return cost <= self.account(cls).free

    def take(self, cls: str, cost: int) -> None:
        if not self.fits(cls, cost):
            raise RuntimeError(f"{cls}: cost {cost} does not fit ({self.account(cls).free} free)")
        self.accounts[cls].in_use += cost

    def give_back(self, cls: str, cost: int) -> None:
        account = self.account(cls)
        if cost > account.in_use:
            raise RuntimeError(f"{cls}: releasing {cost} but only {account.in_use} is in use")
        account.in_use -= cost

    def set_budgets(self, budgets: Mapping[str, int]) -> None:
        for cls, budget in check_budgets(budgets).items():
            self.accounts.setdefault(cls, ClassAccount(0)).budget = budget
