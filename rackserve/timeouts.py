"""Every wait, period and bound of the runtime, in seconds, in one place (`TIMEOUTS`).

They are not settings a deployment tunes (those are `EngineConfig` and `ServeConfig` fields, such as
a gang's step `timeout`): each is what the code it names needs to stay responsive, or to tell a slow
peer from a dead one, and says why it is what it is. A test that needs another value replaces the
record where it is read (`monkeypatch.setattr(module, "TIMEOUTS", replace(TIMEOUTS, …))`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Timeouts:
    # ---- the engine and the transfers (rackserve.engine, rackserve.transfer) ----------------------------
    engine_kv_poll_s: float = 0.001  # how long an engine with nothing to run but transfers pending sleeps per step
    push_margin_s: float = 1.0  # a push starts at least this long before its reservation expires
    # a READ of a cached prefix from a KV store not done this long is given up and the prompt prefilled
    # (a READ takes milliseconds, but one from a store whose process is stopped or stalled never ends)
    pull_s: float = 5.0

    # ---- the actors (rackserve.actors) --------------------------------------------------------------------
    consumer_silent_s: float = 30.0  # a DP rank's consumer silent this long is gone: its requests are aborted
    store_busy_poll_s: float = 0.001  # a KV store's poll for landed writes while writes keep coming ...
    store_idle_poll_s: float = 0.02  # ... and once none came for `store_busy_for_s`
    store_busy_for_s: float = 1.0
    table_watch_s: float = 2.0  # how often a node's table host looks for the processes that map its tables
    # a table host whose tables no process has mapped (nor asked for) this long removes them and exits:
    # longer than a gang restart takes to map them again, so a restart never re-reads them
    table_idle_s: float = 120.0

    # ---- gangs (rackserve.cluster.gang_supervisor, faults) ------------------------------------------------
    gang_place_s: float = 10.0  # how long a restart waits for its placement group to hold every bundle
    # how long a start waits for every member's process to run (a worker process starting, importing
    # torch), and the first start for its new placement group: longer means the node is gone, or full
    gang_start_s: float = 60.0
    diagnose_ping_s: float = 5.0  # a member that does not answer a ping this long after a failure is stalled

    # ---- the owner of a deployment and its clients (rackserve.cluster) -----------------------------------
    load_period_s: float = 0.2  # how often the owner gathers the ranks' load reports
    load_stale_s: float = 3.0  # a rank whose load report is this old is not routed to (its node may be gone)
    load_refresh_s: float = 0.25  # how often a client takes the ranks' reported loads from the owner
    watch_s: float = 1.0  # how often the owner looks for dead KV stores and failed gangs (to replace them)
    member_ping_s: float = 5.0  # how long the watcher waits for a gang's pings (a slow member: the gang's timeout)
    store_ping_s: float = 0.5  # how long the watcher waits for the stores' pings per pass (one unanswered stays out)
    # a KV store that answers no ping this long is stalled (its process stopped, its host swapping): it is
    # replaced like a dead one, as it is only a cache and a stalled one serves nobody (its READs and lookups
    # are given up); a store merely busy answers within milliseconds
    store_stall_s: float = 15.0
    store_call_s: float = 5.0  # a KV store call (a lookup, a writer added) not answered this long is given up
    store_retry_s: float = 1.0  # a KV store found dead is asked for the owner's replacement after this long
    output_poll_s: float = 1.0  # an output pump's long-poll: an idle DP rank answers one poll per second
    replay_s: float = 60.0  # how long a request whose decode gang failed is tried again before it ends in error
    replay_retry_s: float = 1.0  # between two attempts to replay a request

    # ---- the data plane behind Serve (rackserve.serve.controller, health) ---------------------------------
    placement_s: float = 300.0  # how long a data plane waits for the planned placement groups to be reserved
    health_ping_s: float = 5.0  # every rank of a serving instance answers a health ping within this
    health_window_s: float = 60.0  # the recent past that failure rates cover
    health_sample_s: float = 5.0  # how often the controller samples the transfer counters
    orphan_s: float = 30.0  # a data plane whose Serve app has been gone this long shuts itself down
    replica_stale_s: float = 5.0  # an ingress replica silent this long (gone) no longer counts in `inflight`

    # ---- the ingress replicas and their drain (rackserve.serve.app, drain) --------------------------------
    replica_report_s: float = 0.25  # how often a replica reports its requests in progress and learns if it drains
    # Serve's health check of a replica: a data plane not answering this long is busy, not dead (under
    # the health check's own 10 s timeout)
    data_plane_check_s: float = 5.0
    retry_after_s: int = 1  # what a refused request's Retry-After header says (whole seconds, as HTTP wants)
    drain_poll_s: float = 0.25  # how often the drain reads the replicas' counts
    drain_call_s: float = 30.0  # a data plane that does not answer this long is not waited for: the app is deleted
    drain_end_wait_s: float = 10.0  # how long the replicas get to end their requests once told to

    # ---- rackserve check-gpu ---------------------------------------------------------------------------------
    check_transfer_s: float = 30.0  # one NIXL write of the check completes, notification and all, within this


TIMEOUTS = Timeouts()
