"""Request classes by cost: a request's class is the cost band it falls in, unless the caller names it.

Failover re-prefills always go to FAILOVER, whose dedicated budget lets a cluster loss re-prefill its
sessions on the survivors without spending (or starving) the budgets of the survivors' own traffic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.admission.cost_model import CostModel
from services.admission.ledger import REQUEST_CLASSES

# Band edges as the requests that sit on them: up to an 8K prompt with 1K output is SHORT, up to a
# 128K prompt with 4K output is MEDIUM, anything longer is LONG.
SHORT_EDGE = (8_192, 0, 1_024)
MEDIUM_EDGE = (131_072, 0, 4_096)


@dataclass(frozen=True)
class Classified:
    request_class: str
    cost: int
    # The prefill part of cost, returnable at the first token.
    prefill_cost: int = 0
    # The class by cost alone (differs from request_class for failover and explicit classes).
    cost_class: str = ""


class RequestClassifier:
    def __init__(self, model: CostModel, short_max_cost: float | None = None,
                 medium_max_cost: float | None = None):
        self.model = model
        self.short_max_cost = short_max_cost if short_max_cost is not None else model.cost(*SHORT_EDGE)
        self.medium_max_cost = medium_max_cost if medium_max_cost is not None else model.cost(*MEDIUM_EDGE)
        if not 0 < self.short_max_cost < self.medium_max_cost:
            raise ValueError("class edges: need 0 < short_max_cost < medium_max_cost")

    def classify(self, prompt_tokens: int, cached_tokens: int, max_output_tokens: int,
                 failover: bool = False, override: str | None = None) -> Classified:
        if prompt_tokens <= 0:
            raise ValueError("prompt_tokens: must be > 0")
        if cached_tokens > prompt_tokens:
            raise ValueError(f"cached_tokens: {cached_tokens} exceeds prompt_tokens {prompt_tokens}")
        if override is not None and override not in REQUEST_CLASSES:
            raise ValueError(f"request_class: unknown class {override!r}")
        prefill = math.ceil(self.model.prefill(prompt_tokens, cached_tokens))
        cost = prefill + math.ceil(self.model.decode(prompt_tokens, max_output_tokens))
        if cost <= self.short_max_cost:
            cost_class = "SHORT"
        else:
            cost_class = "MEDIUM" if cost <= self.medium_max_cost else "LONG"
        request_class = "FAILOVER" if failover else override or cost_class
        return Classified(request_class, cost, prefill, cost_class)
