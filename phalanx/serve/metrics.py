"""What /metrics shows, in the Prometheus text format (prometheus_client), in a registry of
the server's own (so tests and several servers in one process do not share counters).

Updated by the engine thread after every step (`after_step`) and when a request ends
(`request_done`); the names are listed with their meaning in docs/serve.md.
"""

from __future__ import annotations

import sys
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
EXPERT_WINDOW = 64
"""Engine steps over which phalanx_expert_imbalance is taken."""


class ServeMetrics:
    def __init__(self, moe: bool = False, slo=None):
        """`slo`: the `slo_policy.SloTargets` of --ttft-ms/--tpot-ms, or None."""
        self.registry = registry = CollectorRegistry()
        self.running = Gauge("phalanx_requests_running", "Requests in the running batch", registry=registry)
        self.waiting = Gauge("phalanx_requests_waiting", "Requests waiting to run (preempted ones included)", registry=registry)
        self.blocks_used = Gauge("phalanx_kv_blocks_used", "KV cache blocks held by sequences", registry=registry)
        self.blocks_free = Gauge("phalanx_kv_blocks_free", "KV cache blocks free (prefix-cached ones included)", registry=registry)
        self.prefix_queries = Counter("phalanx_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=registry)
        self.prefix_hits = Counter("phalanx_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=registry)
        self.preemptions = Counter("phalanx_preemptions", "Sequences preempted (freed, requeued, recomputed)", registry=registry)
        self.prompt_tokens = Counter("phalanx_prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter("phalanx_generation_tokens", "Tokens generated", registry=registry)
        self.guessed = Counter("phalanx_spec_decode_draft_tokens", "Tokens guessed by speculative decoding "
                               "(--speculative-config)", registry=registry)
        self.kept = Counter("phalanx_spec_decode_accepted_tokens", "Guessed tokens kept (the model drew the same)",
                            registry=registry)
        self.acceptance = Gauge("phalanx_spec_decode_acceptance_rate", "Guessed tokens kept over guessed, since the "
                                "start (0 before any guess)", registry=registry)
        self.finished = Counter("phalanx_requests_finished", "Requests ended, by reason (stop, length, abort, error)",
                                ["finish_reason"], registry=registry)
        self.ttft = Histogram("phalanx_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.tpot = Histogram("phalanx_time_per_output_token_seconds", "Mean time per token after the first, per request",
                              buckets=TOKEN_BUCKETS, registry=registry)
        self.e2e = Histogram("phalanx_e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS,
                             registry=registry)
        self._shown: dict[int, float] = {}
        self.moe = moe
        if moe:
            self.imbalance = Gauge("phalanx_expert_imbalance", "(max - mean) / mean of the routed rows per rank, the "
                                   f"largest over MoE layers, over the last {EXPERT_WINDOW} engine steps", registry=registry)
            self.expert_rows = Counter("phalanx_expert_rows", "Routed rows computed per rank (all MoE layers)", ["rank"],
                                       registry=registry)
            self._window: deque[list[list[int]]] = deque(maxlen=EXPERT_WINDOW)  # per step: per layer, rows per rank
            self._add_rebalance_metrics(registry)
        self.slo = slo
        if slo is not None:
            self._add_slo_metrics()

    def after_step(self, scheduler, generated: int, expert_rows: list[list[int]] | None = None) -> None:
        """`expert_rows`: this step's routed rows per rank of each MoE layer, (layers, ranks)."""
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.blocks_used.set(scheduler.blocks.num_used)
        self.blocks_free.set(scheduler.blocks.num_free)
        self._counter_to(self.prefix_queries, scheduler.prefix_query_tokens)
        self._counter_to(self.prefix_hits, scheduler.prefix_hit_tokens)
        self._counter_to(self.preemptions, scheduler.preemptions)
        self.generation_tokens.inc(generated)
        self._counter_to(self.guessed, scheduler.guessed_tokens)
        self._counter_to(self.kept, scheduler.kept_guesses)
        self.acceptance.set(scheduler.kept_guesses / scheduler.guessed_tokens if scheduler.guessed_tokens else 0.0)
        if self.slo is not None and scheduler.slo is not None:
            self._counter_to(self.slo_rejected, scheduler.slo.rejected)
            self.slo_prefill_budget.set(scheduler.slo.last_prefill_budget)
        if self.moe and expert_rows:
            self._window.append(expert_rows)
            for rank, rows in enumerate(map(sum, zip(*expert_rows))):
                self.expert_rows.labels(rank=str(rank)).inc(rows)
            self.imbalance.set(max(imbalance([sum(step[layer][rank] for step in self._window)
                                              for rank in range(len(expert_rows[0]))])
                                   for layer in range(len(expert_rows))))

    def _counter_to(self, counter: Counter, total: float) -> None:
        """Counters follow the scheduler's totals (it counts; they show)."""
        delta = total - self._shown.get(id(counter), 0)
        if delta > 0:
            counter.inc(delta)
            self._shown[id(counter)] = total

    def request_done(self, seq, reason: str) -> None:
        self.finished.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(len(seq.prompt))
        if seq.first_token_at is None or seq.finished_at is None:
            return
        self.ttft.observe(seq.first_token_at - seq.arrival)
        self.e2e.observe(seq.finished_at - seq.arrival)
        tpot = (seq.finished_at - seq.first_token_at) / (len(seq.output) - 1) if len(seq.output) > 1 else None
        if tpot is not None:
            self.tpot.observe(tpot)
        if self.slo is not None and reason in ("stop", "length"):
            met = self.slo.met(seq.first_token_at - seq.arrival, tpot)
            (self.slo_attained if met else self.slo_missed).inc()

    def _add_slo_metrics(self) -> None:
        """--ttft-ms/--tpot-ms: requests that ended (stop or length) within every target or
        not, those refused at arrival, and the prefill chunk the TPOT target leaves."""
        registry = self.registry
        self.slo_attained = Counter("phalanx_slo_attained", "Finished requests within every latency target",
                                    registry=registry)
        self.slo_missed = Counter("phalanx_slo_missed", "Finished requests beyond a latency target", registry=registry)
        self.slo_rejected = Counter("phalanx_slo_rejected", "Requests refused at arrival: their TTFT target could "
                                    "not be met", registry=registry)
        self.slo_prefill_budget = Gauge("phalanx_slo_prefill_budget_tokens", "Prompt tokens a step with decodes may "
                                        "add within the TPOT target (last chosen)", registry=registry)

    def _add_rebalance_metrics(self, registry) -> None:
        """Live expert re-placement (`--rebalance-every`): how often slots moved, and the last
        move's per-rank imbalance, averaged over the MoE layers."""
        self.rebalances = Counter("phalanx_expert_rebalances", "Expert re-placements that moved slots between ranks "
                                  "while serving", registry=registry)
        self.slots_moved = Counter("phalanx_expert_slots_moved", "Expert slots whose expert changed at a re-placement",
                                   registry=registry)
        self.imbalance_before = Gauge("phalanx_expert_imbalance_before_rebalance", "The last re-placement's (max - mean)"
                                      " / mean of the routed rows per rank before it (measured moving average), mean "
                                      "over MoE layers", registry=registry)
        self.imbalance_after = Gauge("phalanx_expert_imbalance_after_rebalance", "The same after it (the balancer's "
                                     "prediction for the new placement from the same loads)", registry=registry)

    def rebalanced(self, event) -> None:
        """An `ExpertRebalancer` event whose placement moves slots (from the engine thread)."""
        self.rebalances.inc()
        self.slots_moved.inc(event.moved_slots)
        self.imbalance_before.set(event.imbalance_before)
        self.imbalance_after.set(event.imbalance_after)
        print(f"phalanx: expert rebalance at step {event.step}: imbalance {event.imbalance_before:.3f} -> "
              f"{event.imbalance_after:.3f} (predicted), {event.moved_slots} slots moved, {event.bytes_moved} bytes "
              "between ranks", file=sys.stderr, flush=True)

    def text(self) -> bytes:
        return generate_latest(self.registry)


def imbalance(rows_per_rank: list[int]) -> float:
    """(max - mean) / mean; 0 when nothing was routed."""
    mean = sum(rows_per_rank) / len(rows_per_rank)
    return (max(rows_per_rank) - mean) / mean if mean else 0.0
