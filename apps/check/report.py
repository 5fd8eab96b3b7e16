"""What a check run found: counts, anomalies, violations, and its JSON form."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from icebarrier.control_plane.model import Level

COVERAGE_FLOOR = 0.6  # barriers validated / issued and not coalesced


@dataclass
class CheckReport:
    seed: int
    barriers: int = 0
    validated: int = 0
    excused: Counter = field(default_factory=Counter)
    reads: dict[str, int] = field(default_factory=lambda: {lvl.value: 0 for lvl in Level})
    anomalies: dict[str, int] = field(default_factory=lambda: {lvl.value: 0 for lvl in Level})
    examples: dict[str, str] = field(default_factory=dict)
    no_valid_cut: int = 0
    coalesced_refused: int = 0  # cuts refused at a barrier a table coalesced
    anchors_validated: int = 0
    completions: Counter = field(default_factory=Counter)  # exact / skip / coalesce, from the control plane
    read_uncommitted_errors: int = 0
    rr_sessions: int = 0
    leases_renewed: int = 0
    leases_lost: int = 0
    leases_refused: int = 0
    expiry_runs: int = 0
    snapshots_expired: int = 0
    faults: Counter = field(default_factory=Counter)
    restarts: int = 0
    failovers: int = 0  # restarts that were failovers (check --failover): the primary killed, the standby promoted
    waits: list[tuple[str, str, float]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    coverage_floor: float = COVERAGE_FLOOR
    exec_jobs: list[str] = field(default_factory=list)  # the jobs run under `icebarrier job exec`
    mutation: str | None = None  # the deliberate bug the catalog server ran with
    kafka: bool = False  # orders_in read its orders from a Kafka topic (check --kafka)
    catalog_reads: int = 0  # read-committed reads through the catalog server
    catalog_validated: int = 0  # cuts validated through the catalog's barrier-<B> warehouse too
    catalog_planned: int = 0  # of those reads and validations, planned on the server (scan planning)
    catalog_unavailable: int = 0  # catalog reads that found the server down (killed by the schedule)
    catalog_anomalies: int = 0
    catalog_stop_s: list[float] = field(default_factory=list)  # each SIGTERM of the server to its exit
    maintenance: dict[str, int] | None = None  # with --maintain: "action result" -> how many

    @property
    def coverage(self) -> float:
        validatable = self.barriers - self.coalesced_refused
        return self.validated / validatable if validatable else 0.0

    def waited(self) -> dict[str, dict]:
        """Per process (driver, each job, expiry): how many reconnects and the longest wait."""
        out: dict[str, dict] = {}
        for who, _what, seconds in self.waits:
            entry = out.setdefault(who, {"reconnects": 0, "max_wait_s": 0.0})
            entry["reconnects"] += 1
            entry["max_wait_s"] = round(max(entry["max_wait_s"], seconds), 3)
        return out

    def anomaly(self, level: Level, problem: str) -> None:
        self.anomalies[level.value] += 1
        self.examples.setdefault(level.value, problem)

    @property
    def ok(self) -> bool:
        return (
            not self.violations
            and self.anomalies["read-committed"] == 0
            and self.catalog_anomalies == 0
            and self.anomalies["repeatable-read"] == 0
            and self.coverage >= self.coverage_floor
        )

    def to_json(self) -> dict:
        return {
            "seed": self.seed,
            "ok": self.ok,
            "kafka": self.kafka,
            "barriers": self.barriers,
            "validated": self.validated,
            "coverage": round(self.coverage, 3),
            "coverage_floor": self.coverage_floor,
            "excused": dict(self.excused),
            "reads": self.reads,
            "anomalies": self.anomalies,
            "examples": self.examples,
            "no_valid_cut": self.no_valid_cut,
            "coalesced_refused": self.coalesced_refused,
            "anchors_validated": self.anchors_validated,
            "completions": dict(self.completions),
            "read_uncommitted_errors": self.read_uncommitted_errors,
            "rr_sessions": self.rr_sessions,
            "leases_renewed": self.leases_renewed,
            "leases_lost": self.leases_lost,
            "leases_refused": self.leases_refused,
            "expiry_runs": self.expiry_runs,
            "snapshots_expired": self.snapshots_expired,
            "faults": dict(self.faults),
            "restarts": self.restarts,
            "failovers": self.failovers,
            "reconnects": len(self.waits),
            "max_wait_s": round(max((w[2] for w in self.waits), default=0), 3),
            "waited": self.waited(),
            "exec_jobs": self.exec_jobs,
            "mutation": self.mutation,
            "maintenance": self.maintenance,
            "catalog": {
                "reads": self.catalog_reads,
                "validated": self.catalog_validated,
                "planned": self.catalog_planned,
                "unavailable": self.catalog_unavailable,
                "anomalies": self.catalog_anomalies,
                "stop_s": [round(x, 3) for x in self.catalog_stop_s],
            },
            "violations": self.violations,
        }
