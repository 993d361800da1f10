"""Split placement, target ranks: run the target for the drafter ranks it feeds.

Ranks [0, parallel.target_ranks) hold only the target. Each sends its head once to the
drafter ranks it feeds (`Placement.consumers`), then, step after step, runs the target on
each consumer's rows (the same positions of the same row stream the consumer walks) and
sends the taps and labels, soft ones included (`FeatureSender`), at most
`parallel.queue_depth` rows ahead of the drafter. The drafter side is
`flashdraft.train.features.RemoteTarget`.
"""

from __future__ import annotations

from typing import Any

from flashdraft.model.attention import default_backend
from flashdraft.train.features import (
    device_put,
    head_payload,
    load_run_target,
    rows_on_device,
    target_outputs,
)
from flashdraft.train.parallel import FeatureSender, send_head
from flashdraft.train.plan import RunPlan


def serve_target(plan: RunPlan, target_model: Any = None) -> None:
    """Run the target for this rank's consumers until every planned step is fed."""
    config, info = plan.config, plan.info
    target = load_run_target(plan, default_backend(info.device), target_model)
    consumers = plan.placement.consumers(info.rank)
    send_head(head_payload(target.head), consumers)
    senders = {peer: FeatureSender(peer, config.parallel.queue_depth) for peer in consumers}
    streams = {
        peer: plan.stream.iterate(
            plan.positions(plan.placement.drafter_ranks.index(peer)),
            config.data.prefetch if config.parallel.overlap else 0,
        )
        for peer in consumers
    }
    put = device_put(info.device)
    block = plan.drafter_config.block_size
    for _ in range(plan.start_step, plan.total_steps):
        for peer in consumers:
            for _ in range(config.optim.grad_accum):
                rows = [next(streams[peer])]  # row by row: the drafter rank stacks them
                on_device = rows_on_device(rows, put)
                senders[peer].send(target_outputs(target, rows, on_device, put, config.loss, block))
    for sender in senders.values():
        sender.flush()
