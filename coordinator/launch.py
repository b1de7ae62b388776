"""Start the elastic server: Ray (local or joined), Serve, the coordinator app on host:port.

The Serve application has two deployments: the coordinator (`coordinator.controller`: the
HMM, the instances, scaling, repairs) and the ingress (`coordinator.ingress`: HTTP, routing
to the published ranks). The ingress listens on host:port itself and Serve runs no HTTP proxy
(`coordinator.ingress_http`: a streamed token then crosses one process less). `start_elastic`
returns once the coordinator has brought up the HMM and activated the first instance and the
ingress follows it (Serve only routes to a replica whose constructor finished);
`ElasticServer.shutdown` undoes everything it started, in order: instance + HMM memory
(explicitly, so no /dev/shm file outlives the server), then Ray if it started it (which ends
Serve with it; on a joined cluster: Serve), then whatever Ray left behind, then the /dev/shm
files of any owner that died. Every step has a time bound. `serve_elastic` adds SIGTERM/SIGINT:
drain (new requests 503, those in flight finish up to `shutdown_timeout_s`), then shut down. A
process group SIGTERMed at once (systemd's default) drains the same way while Ray's raylet
still runs (its own shutdown waits ~10 s on the GCS, which stops answering at once); the
shutdown then finds the GCS silent and ends Ray's processes instead of calling into them, and
frees what dead owners left.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from types import FrameType
from typing import Any

import ray
from ray import serve

from coordinator.config import CoordinatorConfig
from coordinator.controller import Coordinator
from coordinator.ingress import Ingress
from coordinator.ingress_http import HttpBinding
from coordinator.process_tree import (
    become_subreaper,
    call_with_timeout,
    child_running,
    end_children,
    end_descendants,
    is_alive,
)
from elasticmoe.entrypoints.listen_address import AddressUnavailable, check_address_free
from hmm.local_ray import init_local_ray
from hmm.memory.lease import reap
from hmm.placement import DEVICE_RESOURCE

logger = logging.getLogger(__name__)

APP_NAME = "elasticmoe"
_ADMIN_SLACK = 64  # Serve slots beyond --max-queued, so that overflow reaches our 503 and probes pass
# Ray's head node offers this resource: the coordinator and the ingress run there, so losing a
# worker node never takes them (the head holds the GCS and Serve's controller anyway).
HEAD_RESOURCE = "node:__internal_head__"
# Set in the environment of a local Ray this process starts (its processes inherit it), unless
# already set. Serve's controller reconciles every 0.1 s by default: on an idle dp-1 server here
# that was 4.4-4.9% of a core, and 2.1-2.3% at 0.5 s (the whole server 22-23% -> 19-20%), CPU the
# rank needs on a small node. Replica failures are still acted on within half a second (Serve's
# health checks run every 10 s anyway); the test suite has run at 0.5 s throughout.
#
# glibc's malloc in every Ray process at two arenas (it makes up to 8 per core, one per thread that
# meets a locked one, and Ray's threads allocate on many): over stretches of 1,600 requests the
# coordinator's resident memory grew by ~0.4 MB each with glibc's default and not at all with two,
# the ingress's by ~1.1 and ~0.6 MB, levelling off after ~30,000 requests (docs/resilience.md, "A
# long run does not grow"); an engine's TPOT did not change. The Helm chart sets it in its pods.
#
# OpenMP threads that spin ~0.1 ms when they wait, then sleep (`OMP_WAIT_POLICY=PASSIVE` with
# `GOMP_SPINCOUNT=10000`; libgomp counts ~100,000 spins a millisecond and spins 300,000 by default):
# a rank's second thread waits at the end of every kernel and through each step's single-threaded
# parts, and spinning through the latter takes the core the ingress, the clients' connections and
# Ray's daemons need. Zen 5, 2 vCPUs, dp 1, 64 streaming clients (bf16, 128 in / 64 out), runs in
# turn: libgomp's default 1,204-1,645 output tok/s (median 1,430), the rank 148-155% of a core;
# `PASSIVE` alone (no spin: every kernel wakes the thread, and a vCPU woken from halt is slow here)
# 1,489-1,759 (median 1,560 in six runs), TTFT p50 median 464 ms, the rank 113-115% of a core and
# ~18% of both cores idle; with the short spin 1,625-1,777 (median 1,663 in six), 409 ms, the rank
# ~130% and ~10% idle. Spins of 20,000 and 30,000 were level with 10,000. `PASSIVE` keeps it from
# spinning at all where libgomp finds more threads than cores. `serve --single` (no Ray) keeps
# libgomp's default: there `PASSIVE` lost (1,877 / 1,920 -> 1,544 / 1,773 tok/s), its HTTP work
# running on the engine's own process.
LOCAL_RAY_DEFAULTS = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "MALLOC_ARENA_MAX": "2",
    "OMP_WAIT_POLICY": "PASSIVE",
    "GOMP_SPINCOUNT": "10000",
}
_ON_HEAD = {"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.001}}
# Serve logs every call a replica answers; the coordinator's are internal (the ingress reports its
# observations four times a second under traffic, long polls, scrapes): ~14,000 lines an hour of
# "CALL observe OK". Its own log says what it does (scales, repairs, errors).
_QUIET = {"enable_access_log": False}


class ClusterUnreachable(ConnectionError):
    """`--address` names a Ray cluster this process cannot join (down, or a token is missing)."""


@dataclasses.dataclass
class ElasticServer:
    """A running elastic server; `shutdown()` is idempotent and bounded in time: a cluster that is
    half gone (its raylet SIGTERMed with the rest of the process group) is torn down anyway."""

    url: str
    config: CoordinatorConfig
    handle: Any  # DeploymentHandle of the ingress
    coordinator: Any  # DeploymentHandle of the coordinator
    owns_ray: bool
    ingress_pid: int | None = None  # the replicas' processes, when they run on this node
    coordinator_pid: int | None = None
    raylet_pid: int | None = None  # their parent: this node's raylet
    is_shut_down: bool = False

    def raylet_gone(self) -> bool:
        """This node's raylet died (the process group was SIGTERMed at once): Ray's calls hang."""
        return self.raylet_pid is not None and not is_alive(self.raylet_pid)

    def drain(self, timeout_s: float | None = None) -> dict:
        """New `/v1/*` requests get 503, those in flight finish (up to `timeout_s`, default the
        config's `shutdown_timeout_s`); the autoscaler stops. What happened, as a dict (empty if
        the drain failed: logged). Gives up at once if the ingress's process or the raylet is gone."""
        wait = self.config.shutdown_timeout_s if timeout_s is None else timeout_s
        outcome: dict = {}

        def drain() -> None:
            outcome.update(self._result(self.handle.drain.remote(timeout_s), wait + 30, "drain", "ingress"))

        # NOTE: on a thread, abandoned once the raylet is gone: a handle that never routed asks the
        # GCS for its node first, without a timeout, and a signal to the whole process group may
        # have taken the GCS down while the server started.
        call_with_timeout(drain, wait + 60, "drain", give_up=self.raylet_gone)
        return outcome

    def _replica_alive(self, which: str) -> bool:
        """False once the `which` replica's process is gone and Serve has not started another (a
        replica Serve restarted has a new pid, looked up here; only known on its node)."""
        if self.raylet_gone():  # every process of this node went with it
            return False
        pid = getattr(self, f"{which}_pid")
        if pid is None or is_alive(pid):
            return True
        pid = _local_pid(self.handle if which == "ingress" else self.coordinator, which, timeout_s=2.0)
        setattr(self, f"{which}_pid", pid)
        return pid is not None and is_alive(pid)

    def _result(self, response: Any, timeout_s: float, what: str, which: str) -> Any:
        """A replica call's result; raises as soon as that replica's process is gone."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._replica_alive(which):
                raise RuntimeError(f"{what}: the {which}'s process is gone")
            try:
                return response.result(timeout_s=0.5)
            except TimeoutError:
                continue
        raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s")

    def shutdown(self, timeout_s: float = 120.0) -> bool:
        """Everything started is stopped and this node's /dev/shm files of dead owners are freed.
        Returns False if Ray could not be shut down in order (its raylet died under it): then
        Ray's processes were ended by signal, and a process should `os._exit` rather than run
        Ray's exit hooks."""
        if self.is_shut_down:
            return True
        self.is_shut_down = True
        if self.owns_ray and not self.cluster_answers():
            # The whole process group was signalled (systemd's default): Ray's GCS and raylet are
            # shutting down, so every call below would wait on them (the coordinator's for ~10 s,
            # as long as the raylet's own shutdown waits on the GCS), and there is nothing left to
            # do in order: the drain is over. Ray's processes end now; dead owners' files go below.
            logger.warning("Ray's GCS no longer answers (its process group was signalled); ending Ray's processes")
            end_descendants()
            orderly = False
        else:
            orderly = self._shutdown_in_order(timeout_s)
        # NOTE: a device worker that died (or was killed before freeing) leaves its files here.
        reap(self.config.shm_prefix)
        logger.info("elastic server stopped")
        return orderly

    def _shutdown_in_order(self, timeout_s: float) -> bool:
        """The coordinator stops the instances and frees the devices, then Serve (a joined
        cluster's) or Ray (our own) ends; False if Ray's raylet died meanwhile."""
        try:
            self._result(self.coordinator.shutdown_cluster.remote(), timeout_s, "coordinator shutdown",
                         "coordinator")
        except Exception as exc:  # noqa: BLE001 - the rest still runs
            logger.warning("coordinator shutdown failed (%s)", exc)
        if not self.owns_ray:
            # NOTE: with the raylet gone none of Ray's calls returns; serve.shutdown is then abandoned
            # on its thread, and Ray must not be shut down under it (that aborts the process).
            return call_with_timeout(serve.shutdown, 60, "serve.shutdown", give_up=self.raylet_gone)
        # NOTE: no serve.shutdown on our own cluster: ray.shutdown ends Serve's controller and
        # replicas with it, while Serve's teardown takes ~4 s of its control loop's passes (0.5 s
        # each here, `LOCAL_RAY_DEFAULTS`) to stop replicas that have nothing left to do.
        orderly = not self.raylet_gone()
        if orderly:
            ray.shutdown()  # NOTE: on this thread: Ray aborts when shut down from another one
        end_children()  # what Ray left behind (its raylet died before its workers), or all of it
        return orderly

    def cluster_answers(self, timeout_s: float = 1.0) -> bool:
        """This node's raylet lives and Ray's GCS answers within `timeout_s` (`gcs_answers`)."""
        return not self.raylet_gone() and gcs_answers(timeout_s)


def coordinator_app(config: CoordinatorConfig, http: HttpBinding | None = None) -> Any:
    """The Serve application for `config`: the coordinator, and the ingress that follows it (and
    listens on `http` itself; without it, Serve's proxy is the way in)."""
    coordinator = Coordinator.options(  # type: ignore[attr-defined]
        ray_actor_options=_ON_HEAD, logging_config=_QUIET).bind(config)
    ingress = Ingress.options(  # type: ignore[attr-defined]
        max_ongoing_requests=config.max_queued + _ADMIN_SLACK, ray_actor_options=_ON_HEAD)
    return ingress.bind(config, coordinator, http)


def start_elastic(
    config: CoordinatorConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    ray_init_kwargs: dict[str, Any] | None = None,
    after_ray_init: Callable[[], None] | None = None,
    via_serve_proxy: bool = False,
) -> ElasticServer:
    """Connect to (`address`) or start a local Ray, deploy the coordinator on host:port, wait until ready.

    A local Ray offers `config.num_devices` devices on its node; a joined cluster's nodes offer
    theirs (`elasticmoe_device`), and the server uses every one (`coordinator.nodes`).

    `after_ray_init` runs right after `ray.init` (which installs its own SIGTERM handlers).
    `via_serve_proxy`: Serve's HTTP proxy listens on host:port instead of the ingress, the way
    a KubeRay RayService runs the application (`coordinator.deployment`).
    """
    owns_ray = not ray.is_initialized()
    if owns_ray:
        kwargs = dict(ray_init_kwargs or {})
        if address is None:  # the local cluster's one node offers the configured devices (coordinator.nodes)
            apply_local_ray_defaults(os.environ)
            become_subreaper()  # Ray's workers outliving their raylet become ours to end (process_tree)
            kwargs["resources"] = {**kwargs.get("resources", {}), DEVICE_RESOURCE: config.num_devices}
        try:
            if address is None:
                init_local_ray(**kwargs)
            else:
                ray.init(address=address, include_dashboard=False, **kwargs)
        except ConnectionError as exc:
            if address is None:
                raise
            raise ClusterUnreachable(
                f"--address {address}: cannot join the Ray cluster ({exc}). Is it up? With token "
                f"authentication (Ray 2.60 turns it on) this process needs RAY_AUTH_MODE=token and the "
                f"cluster's RAY_AUTH_TOKEN in its environment") from exc
        _RAYLET.pid = child_running("raylet/raylet") if address is None else None
    if after_ray_init is not None:
        after_ray_init()
    try:
        if via_serve_proxy:
            serve.start(http_options={"host": host, "port": port})
            handle = serve.run(coordinator_app(config), name=APP_NAME, route_prefix="/")
        else:
            serve.start(proxy_location="Disabled")
            handle = serve.run(coordinator_app(config, HttpBinding(host, port)), name=APP_NAME, route_prefix=None)
    except BaseException:
        # The coordinator may have started devices (their /dev/shm files) before the application
        # failed, e.g. an ingress whose port was taken after the CLI checked it: end them all, then
        # free the files their dead owners left, as `ElasticServer.shutdown` does.
        serve.shutdown()
        if owns_ray:
            ray.shutdown()
            end_children()
        reap(config.shm_prefix)
        raise
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    logger.info("elastic server ready at %s: %s, dp %d", url, config.model_name, config.dp)
    # NOTE: neither checked with Serve's controller nor recorded as usage (a write to the GCS without
    # a timeout): if a signal took the cluster down while the app started, either would hang.
    coordinator = serve.get_deployment_handle("coordinator", APP_NAME, _check_exists=False, _record_telemetry=False)
    return ElasticServer(url, config, handle, coordinator, owns_ray, _local_pid(handle, "ingress"),
                         _local_pid(coordinator, "coordinator"), _RAYLET.pid if owns_ray else None)


def apply_local_ray_defaults(environ: MutableMapping[str, str]) -> None:
    """`LOCAL_RAY_DEFAULTS` into `environ` where it holds no value of its own."""
    for name, value in LOCAL_RAY_DEFAULTS.items():
        environ.setdefault(name, value)


def gcs_answers(timeout_s: float = 1.0) -> bool:
    """Ray's GCS answers a call within `timeout_s`. A GCS that was SIGTERMed stops answering at
    once (the call fails in milliseconds, or times out), while its process lives on."""
    try:
        client = ray._private.worker.global_worker.gcs_client  # type: ignore[attr-defined]
    except AttributeError:  # Ray's internals moved: assume it answers (every wait has its bound anyway)
        return True
    try:
        client.internal_kv_get(b"elasticmoe-probe", None, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure to answer is the answer
        logger.info("Ray's GCS did not answer (%s)", exc)
        return False
    return True


def _local_pid(handle: Any, what: str, timeout_s: float = 10.0) -> int | None:
    """The pid of a replica's process when it runs on this node (only the shutdown's shortcuts need
    it); None when unknown. A signal to the whole process group may take the cluster down while the
    server starts: then the GCS stops answering, and a handle's first call asks it for its node
    without a timeout, so the call runs on a thread, abandoned once our raylet is gone."""
    if not gcs_answers():
        return None
    found: list[tuple[str, int]] = []
    if not call_with_timeout(lambda: found.append(handle.process.remote().result(timeout_s=timeout_s)),
                             timeout_s + 5, f"finding the {what}'s process", give_up=_RAYLET.gone):
        return None
    node, pid = found[0]
    return int(pid) if node == ray.util.get_node_ip_address() else None


@dataclasses.dataclass
class _Raylet:
    """This node's raylet, once `ray.init` started it as our child (None: not ours, or unknown)."""

    pid: int | None = None

    def gone(self) -> bool:
        return self.pid is not None and not is_alive(self.pid)


_RAYLET = _Raylet()
_COLLAPSE_GRACE_S = 10.0


def _start_collapse_watchdog(shm_prefix: str) -> None:
    """After a signal: if our raylet died (the whole process group was SIGTERMed) and the orderly
    shutdown has not ended `_COLLAPSE_GRACE_S` later (a call into the dead cluster hangs, at any
    stage, the start included), end Ray's processes, free dead owners' files and exit 0."""
    def watch() -> None:
        gone_at: float | None = None
        while True:
            time.sleep(0.5)
            pid = _RAYLET.pid  # NOTE: read each time: the signal may come before `ray.init` returned
            if pid is not None and not is_alive(pid):
                gone_at = gone_at or time.monotonic()
            if gone_at is not None and time.monotonic() - gone_at > _COLLAPSE_GRACE_S:
                logger.warning("Ray's raylet is gone and the shutdown is stuck; ending what is left")
                end_children(grace_s=2)
                reap(shm_prefix)
                logging.shutdown()
                os._exit(0)

    threading.Thread(target=watch, name="collapse-watchdog", daemon=True).start()


def serve_elastic(
    config: CoordinatorConfig, host: str = "127.0.0.1", port: int = 8000, address: str | None = None
) -> int:
    """Serve `config` until SIGTERM/SIGINT, then shut everything down. Returns an exit code."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting for the drain
        logger.info("received %s; draining for up to %.0f s, then shutting down", signal.Signals(signum).name,
                    config.shutdown_timeout_s)
        if not stop.is_set() and address is None:
            _start_collapse_watchdog(config.shm_prefix)
        stop.set()

    def install_handlers() -> None:
        # NOTE: after `ray.init`, whose C++ failure handler would otherwise abort the process on
        # SIGTERM; a signal during the (long) deployment is then served by shutting down right after.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

    # An address in use is refused before Ray, Serve and the model start (the ingress binds it only
    # then). Joined to a cluster, the ingress runs on its head node, which may be another machine.
    if address is None:
        try:
            check_address_free(host, port)
        except AddressUnavailable as exc:
            print(f"error: --host/--port: {exc.strerror}", file=sys.stderr)
            return 2
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            server = start_elastic(config, host, port, address, after_ray_init=install_handlers)
        except ClusterUnreachable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        try:
            while not stop.wait(0.5):
                pass
            try:
                logger.info("drain: %s", server.drain())
            except Exception as exc:  # noqa: BLE001 - shut down anyway
                logger.warning("drain failed (%s); shutting down", exc)
        finally:
            orderly = server.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not orderly:
        # Ray's exit hooks would wait on (or abort in) a cluster whose raylet is gone; everything
        # of ours is already stopped and freed.
        logging.shutdown()
        os._exit(0)
    return 0
