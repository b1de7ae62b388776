"""What `GET /admin/status`, `/admin/devices` and `/admin/nodes` show of a `ClusterManager`.

Read-only views, built on the caller's thread (they block on Ray calls with short timeouts): a
dead or busy device worker or rank is reported as such, never raised. They read the cluster's
registries without its locks, from copies, so a status page never waits for a scale.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import ray

from coordinator.capacity import NodeState
from coordinator.nodes import discover

if TYPE_CHECKING:
    from coordinator.cluster import ClusterManager
    from imm.instance import Instance


def status(cluster: ClusterManager) -> dict[str, Any]:
    """Active config, instance state and ranks, devices with HMM memory, the running scale event,
    adapters, the standby pool and the idle rank processes."""
    inst, hmm, config = cluster.active, cluster.hmm, cluster.config
    devices = device_info(cluster)
    layout = hmm.layout if hmm is not None else None
    running = cluster.scale_events.running
    routing = cluster.routing
    return {
        "model": config.model_name,
        "coordinator": {"pid": os.getpid()},
        "backend": config.backend,
        "active_config": None if inst is None else {
            "dp": inst.dp, "ep": inst.dp if config.is_expert_parallel else 1, "tp": 1},
        "instance": None if inst is None else {
            "instance_id": inst.instance_id, "state": inst.state.value, "timings_s": inst.timings,
            "ranks": rank_info(inst),
            # per rank, how its weights were attached (vLLM: bytes mapped from the HMM vs copied)
            "attach": [_attach_dict(r) for r in inst.attach_reports],
        },
        "layout_device_ids": list(layout.device_ids) if layout is not None else [],
        "devices": devices,
        "routing": {"version": routing.version, "accepting": routing.is_accepting, "num_ranks": len(routing.ranks)},
        "scale_event": running.to_dict() if running is not None else None,
        "adapters": [a.describe() for a in sorted(cluster.adapters.adapters.values(), key=lambda a: a.order)],
        "adapter_swaps": cluster.adapters.swap_stats(),
        "standby": {
            "enabled": config.standby_pool,
            "dps": sorted(cluster.standby.pool),
            "preparing": cluster.is_preparing_standby,
            "hits": cluster.standby.num_hits,
            "misses": cluster.standby.num_misses,
        },
        "rank_processes": cluster.processes.status(),
    }


def devices_report(cluster: ClusterManager) -> dict[str, Any]:
    """Every registered device, and every node offering devices (a node that just joined shows
    here first, then among the devices once registered)."""
    return {"devices": device_info(cluster), **nodes_report(cluster)}


def nodes_report(cluster: ClusterManager) -> dict[str, Any]:
    """Every alive node offering devices with its state (`active`, `draining`, `drained`,
    `released`), and the lost ones; `removable`: nothing of this server runs there."""
    alive = [dataclasses.asdict(n) for n in discover()] if not cluster.is_shut_down else []
    records = {r["ray_node_id"]: r for r in cluster.nodes.describe()}
    nodes = []
    for node in alive:
        record = records.pop(node["ray_node_id"], None) or {"state": NodeState.ACTIVE.value, "removable": False}
        nodes.append({**node, **record, "home": node["ray_node_id"] == cluster.home_node})
    nodes += [{**r, "home": False} for r in records.values()]  # lost (or gone) nodes
    return {"nodes": nodes, "devices_asked_of_autoscaler": cluster.device_requests.num_asked}


def device_info(cluster: ClusterManager) -> list[dict[str, Any]]:
    """Each registered device: its node, where its worker runs, its memory and state."""
    hmm = cluster.hmm
    devices = []
    for d, spec in sorted(dict(hmm.devices if hmm is not None else {}).items()):  # a copy: never waits for a scale
        info: dict[str, Any] = {"device_id": spec.device_id, "node_id": spec.node_id,
                                "ray_node_id": spec.ray_node_id,
                                "budget_bytes": spec.budget_bytes, "used_bytes": None, "peak_bytes": None,
                                "pid": None, "running_on": None, "state": "alive"}
        if hmm is not None and not cluster.is_shut_down:
            try:
                health, usage = ray.get([hmm.worker(d).check_health.remote(), hmm.worker(d).usage.remote()],
                                        timeout=2.0)
                info.update(used_bytes=usage.used, peak_bytes=usage.peak, pid=health["pid"],
                            running_on=health["ray_node_id"])
            except ray.exceptions.GetTimeoutError:
                info["state"] = "busy"  # a scale's copies; it answers after them
            except Exception:  # noqa: BLE001 - the healer replaces it
                info["state"] = "dead"
        devices.append(info)
    return devices


def rank_info(inst: Instance) -> list[dict[str, Any]]:
    """Each rank's device and process (None once it is gone)."""
    out = []
    for r, rank in enumerate(list(inst.ranks)):
        try:
            where = ray.get(rank.where.remote(), timeout=2.0)
        except Exception:  # noqa: BLE001 - dead or hung: the healer deals with it
            where = {"pid": None, "ray_node_id": None}
        device = inst.device_ids[r] if r < len(inst.device_ids) else None
        out.append({"rank": r, "device_id": device, "pid": where["pid"], "ray_node_id": inst.nodes[r],
                    "running_on": where["ray_node_id"]})
    return out


def _attach_dict(report: Any) -> dict[str, Any]:
    as_dict = getattr(report, "as_dict", None)
    return as_dict() if as_dict is not None else dataclasses.asdict(report)
