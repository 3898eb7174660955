"""Fair share across tenants: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI'24), with per-tenant weights.

Each tenant with live requests (waiting or running) has a counter of the service it got: every
token computed for it adds `prefill_weight` (a prompt position) or `decode_weight` (a generated
one), divided by the tenant's weight. The scheduler admits from the tenant with the lowest counter
and may preempt a tenant that holds more than its share of the batch (scheduler.py). A tenant
that becomes live starts at the lowest live counter (or the last one's that left), so time spent
idle is neither banked as credit nor held against it. Tokens served from the prefix cache, and
positions recomputed after a preemption, cost nothing: they are not charged.

A tenant's counter is dropped when its last request ends, so memory is O(live tenants) whatever
names a trusted gateway header brings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ANONYMOUS = ""  # requests that name no tenant share one (tests, benches; the front ends always name one)


@dataclass
class FairShare:
    prefill_weight: float = 1.0
    decode_weight: float = 2.0
    enabled: bool = True  # off: every counter stays 0 and admission is by priority, then arrival (FCFS)
    counters: dict[str, float] = field(default_factory=dict)  # live tenants only
    live: dict[str, int] = field(default_factory=dict)  # requests per live tenant
    _last_left: float = 0.0

    def joined(self, tenant: str) -> None:
        """A request of `tenant` arrived."""
        count = self.live.get(tenant, 0)
        if count == 0:
            self.counters[tenant] = min(self.counters.values(), default=self._last_left)
        self.live[tenant] = count + 1

    def left(self, tenant: str) -> None:
        """A request of `tenant` ended (once per request, whatever ended it)."""
        count = self.live[tenant] - 1
        if count:
            self.live[tenant] = count
            return
        del self.live[tenant]
        self._last_left = self.counters.pop(tenant)

    def cost(self, prefill_tokens: int, decode_tokens: int, weight: float) -> float:
        """What serving these tokens adds to a tenant's counter."""
        if not self.enabled:
            return 0.0
        return (self.prefill_weight * prefill_tokens + self.decode_weight * decode_tokens) / weight

    def charge(self, tenant: str, amount: float) -> None:
        self.counters[tenant] += amount

    def counter(self, tenant: str) -> float:
        return self.counters[tenant]
