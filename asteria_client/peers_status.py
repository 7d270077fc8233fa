"""The peers part of ``asteria status``: the multi-node jobs' peer groups as one daemon sees them.

Per peer daemon: its node, address, incarnation, state (self / alive / suspect / dead /
unknown), when it was last heard, the blocks it owns and their estimated solve seconds per
version, the push lag to it and the bytes and results sent to and received from it. Per
replicated block: its owner node, the newest version held here and where it came from
(``local`` or ``node<i>``), and its solves, receipts and local fallbacks here.
"""

from __future__ import annotations

from typing import Any

from asteria_client.tables import text_table
from asteria_server.protocol.generated.asteria.v1 import peer_pb2 as ppb


def peers_document(reply: ppb.PeerStatusResponse | None) -> list[dict[str, Any]]:
    """Every peer group as plain JSON values ([] when the daemon has none or cannot say)."""
    if reply is None:
        return []
    out = []
    for group in reply.groups:
        out.append(
            {
                "job": group.job,
                "node": group.node,
                "agreed": group.agreed,
                "waiting": group.waiting,
                "left_to_owner": group.left_to_owner,
                "fallbacks": group.fallbacks,
                "fallback_reasons": dict(group.fallback_reasons),
                "claims_sent": group.claims_sent,
                "claims_granted": group.claims_granted,
                "claims_handed_over": group.claims_handed_over,
                "solves_withdrawn": group.solves_withdrawn,
                "late_arrivals": group.late_arrivals,
                "max_arrival_lag_steps": group.max_arrival_lag_steps,
                "peers": [
                    {
                        "node": p.node,
                        "address": p.address,
                        "incarnation_id": p.incarnation_id,
                        "state": p.state,
                        "last_heard_s": None if p.last_heard_s < 0 else p.last_heard_s,
                        "owned_blocks": p.owned_blocks,
                        "owned_cost_s": p.owned_cost_s,
                        "push_lag_versions": p.push_lag_versions,
                        "push_lag_s": p.push_lag_s,
                        "bytes_sent": p.bytes_sent,
                        "bytes_received": p.bytes_received,
                        "results_sent": p.results_sent,
                        "results_received": p.results_received,
                        "workers_busy": p.workers_busy,
                        "queue_depth": p.queue_depth,
                        "suspected": p.suspected,
                        "died": p.died,
                        "rejoined": p.rejoined,
                    }
                    for p in group.peers
                ],
                "blocks": [
                    {
                        "block": b.block,
                        "n": b.n,
                        "owner": None if b.owner < 0 else b.owner,
                        "version": b.version,
                        "origin": b.origin,
                        "solves": b.solves,
                        "received": b.received,
                        "fallbacks": b.fallbacks,
                        "solved_versions": list(b.solved_versions),
                        "superseded": b.superseded,
                        "taken_over": b.taken_over,
                        "handed_over": b.handed_over,
                        "discarded_versions": list(b.discarded_versions),
                    }
                    for b in group.blocks
                ],
            }
        )
    return out


def _kib(num_bytes: int) -> str:
    return f"{num_bytes / 1024:.1f}"


def format_peers(reply: ppb.PeerStatusResponse | None) -> str:
    """The peers tables ("" when there are no peer groups of more than one daemon)."""
    if reply is None:
        return ""
    parts = []
    for group in reply.groups:
        if len(group.peers) < 2:
            continue  # a job on one daemon: nothing to sync
        head = (
            f"peers of job {group.job} (this daemon: node {group.node}; owners "
            f"{'agreed' if group.agreed else 'not agreed yet'}; {group.waiting} snapshots "
            f"waiting for a push, {group.left_to_owner} left to owners, {group.fallbacks} "
            f"local fallbacks, {group.claims_granted} of {group.claims_sent} claims granted, "
            f"{group.claims_handed_over} handed over)"
        )
        rows = [
            [
                str(p.node),
                p.address,
                p.incarnation_id[:8],
                p.state,
                "-" if p.last_heard_s < 0 else f"{p.last_heard_s:.1f}s",
                str(p.owned_blocks),
                f"{p.owned_cost_s * 1000:.1f}ms",
                f"{p.push_lag_versions}/{p.push_lag_s:.1f}s",
                _kib(p.bytes_sent),
                _kib(p.bytes_received),
            ]
            for p in group.peers
        ]
        table = text_table(
            [
                [
                    "node",
                    "address",
                    "incarn.",
                    "state",
                    "heard",
                    "owns",
                    "cost/ver",
                    "lag v/s",
                    "sent KiB",
                    "recv KiB",
                ],
                *rows,
            ],
            align="><<<>",
        )
        block_rows = [
            [
                b.block,
                str(b.n),
                "-" if b.owner < 0 else f"node{b.owner}",
                str(b.version),
                b.origin or "-",
                str(b.solves),
                str(b.received),
                str(b.fallbacks),
            ]
            for b in group.blocks
        ]
        header = ["block", "n", "owner", "version", "from", "solves", "recv", "fallbk"]
        blocks = text_table([header, *block_rows], align="<>><>")
        parts.append("\n".join([head, *table, *blocks]))
    return "\n".join(parts)
