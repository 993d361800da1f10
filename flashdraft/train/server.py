"""Split placement, target ranks: run the target for the drafter ranks it feeds.

Ranks [0, parallel.target_ranks) hold only the target. Each sends its head once to the
drafter ranks it feeds (`Placement.consumers`), then, step after step, runs the target on
each consumer's rows (the same positions of the same row stream the consumer walks) and
sends the taps and labels, soft ones included (`FeatureSender`), at most
`parallel.queue_depth` rows ahead of the drafter. The drafter side is
`flashdraft.train.features.RemoteTarget`. A stop (SIGTERM, Ctrl-C) is voted on by every rank
at each stop point; a target rank votes before it would send a consumer a row past what that
consumer has posted a receive for, so a stop leaves nothing in flight (train/stopping.py).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from flashdraft.model.attention import default_backend
from flashdraft.train.features import (
    device_put,
    head_payload,
    load_run_target,
    rows_on_device,
    target_outputs,
)
from flashdraft.train.parallel import FeatureSender, send_head, vote_stop
from flashdraft.train.plan import RunPlan
from flashdraft.train.stopping import StopRequest, is_stop_point


def serve_target(
    plan: RunPlan, target_model: Any = None, stop: StopRequest | None = None
) -> int | None:
    """Run the target for this rank's consumers until every planned step is fed, or until
    the ranks vote to stop; returns the step the run stops after (None: it ran to the end)."""
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

    def send(peer: int) -> None:
        rows = [next(streams[peer])]  # row by row: the drafter rank stacks them
        on_device = rows_on_device(rows, put)
        senders[peer].send(target_outputs(target, rows, on_device, put, config.loss, block))
        sent[peer] += 1

    # Rows sent to each consumer, and the stop points still to vote on with the row count
    # each may reach before its vote: the consumer's rows to that step + queue_depth - 1, what
    # the consumer has posted receives for when it votes (`FeatureReceiver.drain`).
    accum, depth = config.optim.grad_accum, max(1, config.parallel.queue_depth)
    sent = dict.fromkeys(consumers, 0)
    points = deque(
        (step, (step - plan.start_step) * accum + depth - 1)
        for step in range(plan.start_step + 1, plan.total_steps)
        if is_stop_point(step, plan.total_steps, config.log.every, config.checkpoint.every)
    )
    control = plan.placement.control
    order = (
        peer
        for _ in range(plan.start_step, plan.total_steps)
        for peer in consumers
        for _ in range(accum)
    )
    stopped, limit = None, 0
    for peer in order:
        while stopped is None and points and sent[peer] >= points[0][1]:  # its next row is past
            step, limit = points.popleft()
            stopped = step if vote_stop(stop is not None and stop.requested, control) else None
        if stopped is not None:
            break
        send(peer)
    while stopped is None and points:  # fed to the end: the votes the drafters still cast
        step, limit = points.popleft()
        stopped = step if vote_stop(stop is not None and stop.requested, control) else None
    if stopped is not None:  # every consumer gets exactly the rows it posted receives for
        for peer in consumers:
            while sent[peer] < min(limit, plan.rows_left):
                send(peer)
    for sender in senders.values():
        sender.flush()
    return stopped
