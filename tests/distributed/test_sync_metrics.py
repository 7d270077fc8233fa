"""The sync's Prometheus metrics: two real daemons on loopback TCP with --metrics-listen, a
2-node job of real gloo ranks, and the scraped peer families against `asteria status`'s peers."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

from tests.distributed import sync_cluster as sc
from tests.integration.test_metrics import scrape, value

PEER_FAMILIES = (
    "asteria_peers",
    "asteria_peer_push_lag_versions",
    "asteria_peer_bytes",
    "asteria_peer_results",
    "asteria_peer_events",
    "asteria_sync_left_to_owner",
    "asteria_sync_fallbacks",
)


def _url(serving_line: str) -> str:
    return serving_line.split(" metrics=", 1)[1].split()[0]


def test_peer_metrics_agree_with_the_peers_status_on_both_daemons(tmp_path: Path) -> None:
    with sc.daemons(tmp_path, 2, env={"ASTERIA_METRICS_LISTEN": "127.0.0.1:0"}) as ds:
        urls = [_url(d.serving_line) for d in ds]
        before = scrape(urls[0])
        assert not any(before.get(f) for f in PEER_FAMILIES), "peer series before any job"

        spec = sc.RunSpec(
            addresses=[d.address for d in ds], node_of_rank=[0, 1], steps=12, frequency=2
        )
        ranks = sc.run_ranks(tmp_path, spec)
        assert all(r["local_fallbacks"] == 0 for r in ranks)
        last = spec.steps - 1
        deadline = time.monotonic() + 10
        while True:  # the last pushes may still be on their way: then the counters settle
            groups = [sc.view(d.address).group for d in ds]
            newest = {b["version"] for g in groups for b in g["blocks"]}
            if newest == {last} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        scraped = [scrape(url) for url in urls]
        groups = [sc.view(d.address).group for d in ds]  # the same numbers, after the scrapes

    t = sc.TENANT
    for metrics, group in zip(scraped, groups, strict=True):
        (peer,) = [p for p in group["peers"] if p["state"] != "self"]
        assert value(metrics, "asteria_peers", tenant=t, state="alive") == 1
        assert value(metrics, "asteria_peers", tenant=t, state="dead") == 0
        sent = value(metrics, "asteria_peer_bytes_total", tenant=t, direction="sent")
        received = value(metrics, "asteria_peer_bytes_total", tenant=t, direction="received")
        assert sent == peer["bytes_sent"] > 0 and received == peer["bytes_received"] > 0
        results = value(metrics, "asteria_peer_results_total", tenant=t, direction="received")
        assert results == peer["results_received"] > 0
        assert value(metrics, "asteria_peer_push_lag_versions", tenant=t) == 0  # all pushed
        assert value(metrics, "asteria_peer_events_total", tenant=t, event="died") == 0
        left = value(metrics, "asteria_sync_left_to_owner_total", tenant=t)
        assert left == group["left_to_owner"] > 0  # the other daemon's blocks were not solved
        assert value(metrics, "asteria_sync_fallbacks_total", tenant=t) == group["fallbacks"] == 0
        sent = value(metrics, "asteria_sync_claims_total", tenant=t, outcome="sent")
        assert sent == group["claims_sent"]
    # What one daemon pushed is what the other received.
    sent_0 = value(scraped[0], "asteria_peer_bytes_total", tenant=t, direction="sent")
    assert sent_0 == value(scraped[1], "asteria_peer_bytes_total", tenant=t, direction="received")


def test_a_jobs_peer_group_ends_after_its_last_session_and_not_before(tmp_path: Path) -> None:
    """Groups used to live as long as the daemon, each with heartbeat and push tasks for every
    peer: a node daemon serving job after job would accumulate them. A group now ends once no
    session of its job has been open on that daemon for group_idle_s (1.5 s here), and not
    while the job trains (the ranks run longer than that, and stay within budget)."""
    env = {**sc.sync_env(group_idle_s=1.5), "ASTERIA_METRICS_LISTEN": "127.0.0.1:0"}
    with sc.daemons(tmp_path, 2, env=env) as ds:
        spec = sc.RunSpec(
            addresses=[d.address for d in ds],
            node_of_rank=[0, 1],
            steps=40,
            frequency=2,
            step_sleep_s=0.1,  # 4 s of training: well past group_idle_s
        )
        seen: list[tuple[float, int]] = []  # (when, groups on both daemons)

        def during() -> None:
            seen.append((time.monotonic(), sum(len(sc.view(d.address).groups) for d in ds)))

        ctx = sc.start_ranks(tmp_path, spec)
        sc.join(ctx, 120.0, during)
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        assert all(r["local_fallbacks"] == 0 for r in ranks)
        # Both groups lived through the training: once up, they stayed up (a group that ended
        # mid-run would show as a dip) for longer than twice group_idle_s. (The ranks' teardown
        # after their sessions closed may outlast group_idle_s on a loaded host, so the last
        # samples may already see them gone.)
        counts = [count for _, count in seen]
        assert 2 in counts, counts
        up = counts.index(2)
        ended = next((i for i in range(up, len(counts)) if counts[i] < 2), len(counts))
        after = counts[ended - 1 :]
        assert all(a >= b for a, b in itertools.pairwise(after)), f"a group came back: {counts}"
        lived_s = seen[ended - 1][0] - seen[up][0]
        assert lived_s > 3.0, f"the groups lived {lived_s:.1f} s of a 4 s run: {counts}"
        deadline = time.monotonic() + 15
        while sum(len(sc.view(d.address).groups) for d in ds) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(sc.view(d.address).groups == [] for d in ds)
        scraped = scrape(_url(ds[0].serving_line))
        assert not scraped.get("asteria_peers"), "peer series of an ended job"
