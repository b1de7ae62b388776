"""A Ray cluster of several nodes on this machine, built as an operator builds one: `ray start
--head`, then `ray start --address` per further node, each offering `elasticmoe_device`.
For the multi-node tests and benchmarks (`--nodes`).

Ray 2.60 turns token authentication on: every node and every driver must carry the same
token, or they are refused with `InvalidAuthToken`. The head's GCS declares a node dead after
about 2 s without answers here (Ray's default is about 15 s), so a killed node is noticed
within a test's patience. As KubeRay does (a Secret in
`RAY_AUTH_TOKEN` on every pod), the nodes get `RAY_AUTH_MODE=token` and a fresh token in
their environment, and so does the server `serve_on` starts (`elasticmoe serve --address`,
its own process: Ray reads the mode when it is imported), and a benchmark's driver
(`run_attached`). Every process of the cluster is
found by its own temp dir, so `stop()` ends this cluster's processes and never another
Ray on the machine.

With `netns=True` every worker node runs in its own network namespace (`coordinator.bench.netns`):
the head, the server and a benchmark's driver stay on the host and reach the nodes through a
bridge, so what crosses nodes crosses a veth, counted by `interface_bytes()`, and nothing works
only because every node shares 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from coordinator.bench.netns import NodeNetwork
from coordinator.process_tree import descendants
from elasticmoe.utils.ports import free_port
from hmm.placement import DEVICE_RESOURCE

RAY = str(Path(sys.executable).with_name("ray"))


@dataclass
class RayNodes:
    temp_dir: str
    address: str
    env: dict[str, str]
    num_nodes: int = 0
    log: list[str] = field(default_factory=list)
    network: NodeNetwork | None = None  # with `netns`: the bridge and the worker nodes' namespaces
    client_port: int = 0  # the head's Ray Client server (its own port: 10001 by default, shared by every cluster)

    def _start(self, *args: str, devices: int, cpus: int, prefix: tuple[str, ...] = ()) -> None:
        cmd = [*prefix, RAY, "start", *args, "--num-cpus", str(cpus), "--resources",
               json.dumps({DEVICE_RESOURCE: devices}), "--disable-usage-stats", "--temp-dir", self.temp_dir]
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        self.num_nodes += 1

    def add_node(self, devices: int = 1, cpus: int = 1) -> None:
        """One more node joins the cluster, offering `devices` devices (in a namespace of its own
        with `netns`)."""
        if self.network is None:
            self._start("--address", self.address, devices=devices, cpus=cpus)
            return
        ns, node_ip = self.network.add_namespace()
        self._start("--address", self.address, "--node-ip-address", node_ip, devices=devices, cpus=cpus,
                    prefix=tuple(self.network.exec_in(ns)))

    def interface_bytes(self) -> dict[str, int]:
        """With `netns`: bytes each worker node's veth carried so far (in + out), by host-side veth
        name; without, {} (everything goes over the shared loopback)."""
        return self.network.interface_bytes() if self.network is not None else {}

    def kill_node(self, ray_node_id: str) -> int:
        """kill -9 one node: its raylet and every process under it (its workers: device workers,
        ranks, replicas). Returns how many processes were killed."""
        out = subprocess.run(["pgrep", "-f", f"raylet/raylet .*--node_id={ray_node_id}"], capture_output=True,
                             text=True)
        raylets = [int(p) for p in out.stdout.split() if self.temp_dir in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(raylets) == 1, f"no (or more than one) raylet of node {ray_node_id}: {raylets}"
        victims = sorted(descendants(raylets[0]))
        for pid in [raylets[0], *victims]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return 1 + len(victims)

    def pids(self) -> list[int]:
        """Every live process of this cluster: those whose command line names its temp dir, what
        they started (a raylet's agents rename themselves, `ray::DashboardAgent`, and lose the temp
        dir from theirs) and the head's Ray Client server (named by its port only). Missed, the
        last two outlived the cluster by minutes."""
        named = subprocess.run(["pgrep", "-f", self.temp_dir], capture_output=True, text=True)
        client = subprocess.run(["pgrep", "-f", f"ray.util.client.server .*--port={self.client_port} "],
                                capture_output=True, text=True)
        ours = [int(p) for p in named.stdout.split()]
        return sorted({*ours, *descendants(*ours), *map(int, client.stdout.split())})

    def stop(self) -> None:
        for _ in range(3):
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        if self.network is not None:  # NOTE: after the processes: a namespace in use outlives its deletion
            self.network.teardown()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


# The GCS declares a node dead after a few missed health checks (default about 15 s).
FAST_NODE_DEATH = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "500",
                   "RAY_health_check_timeout_ms": "500", "RAY_health_check_failure_threshold": "4"}


@contextlib.contextmanager
def ray_nodes(head_devices: int = 1, worker_devices: tuple[int, ...] = (1,), cpus: int = 1,
              netns: bool = False) -> Iterator[RayNodes]:
    """A head offering `head_devices` and one worker node per entry of `worker_devices`; with
    `netns`, each worker node (and each one `add_node` adds) in its own network namespace, the
    head on the host at the bridge's address. All is torn down on exit, also when the start fails."""
    token = secrets.token_hex(16)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, **FAST_NODE_DEATH}
    temp_dir = tempfile.mkdtemp(prefix="emoe-ray-")
    port = free_port()
    nodes = RayNodes(temp_dir, f"127.0.0.1:{port}", env, client_port=free_port())
    try:
        head_ip: tuple[str, ...] = ()
        if netns:
            nodes.network = NodeNetwork.create()
            nodes.address = f"{nodes.network.bridge_address}:{port}"
            head_ip = ("--node-ip-address", nodes.network.bridge_address)
        nodes._start("--head", "--port", str(port), *head_ip, "--include-dashboard=false",
                     "--ray-client-server-port", str(nodes.client_port), devices=head_devices, cpus=cpus)
        for devices in worker_devices:
            nodes.add_node(devices, cpus)
        yield nodes
    finally:
        nodes.stop()


_ATTACHED = "ELASTICMOE_BENCH_NODES"  # a child run by `run_attached`: its cluster's temp dir and address


def run_attached(nodes: RayNodes, module: str, argv: list[str]) -> int:
    """Run `python -m module argv` as a driver of `nodes` and return its exit status. A child
    process, because Ray reads its token mode when it is imported: a process that imported Ray
    before the cluster existed can never join it. stdout and stderr are this process's."""
    network = asdict(nodes.network) if nodes.network is not None else None
    spec = {"temp_dir": nodes.temp_dir, "address": nodes.address, "network": network}
    env = {**nodes.env, _ATTACHED: json.dumps(spec)}
    return subprocess.run([sys.executable, "-m", module, *argv], env=env).returncode


def attached() -> RayNodes | None:
    """In a child of `run_attached`: the cluster it was started on (its address, `kill_node`,
    `interface_bytes`); elsewhere None. The child never stops it: its starter does."""
    spec = os.environ.get(_ATTACHED)
    if spec is None:
        return None
    fields = json.loads(spec)
    network = NodeNetwork(**fields["network"]) if fields.get("network") else None
    return RayNodes(fields["temp_dir"], fields["address"], dict(os.environ), network=network)


def parse_nodes(text: str) -> tuple[int, ...]:
    """`--nodes 2,1` -> (2, 1): the devices each node offers, the head's first; `ValueError` otherwise."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if len(counts) < 2 or any(c < 0 for c in counts) or sum(counts) < 1:
        raise ValueError(f"--nodes: want D0,D1,... devices per node (at least two nodes), got {text!r}")
    return counts


@dataclass
class Served:
    url: str
    process: subprocess.Popen
    output: Path


@contextlib.contextmanager
def serve_on(nodes: RayNodes, *flags: str, timeout_s: float = 180) -> Iterator[Served]:
    """`elasticmoe serve --address` on `nodes` with `flags`, until it is ready; on exit SIGTERM,
    and the process must end by itself (drain, then the devices' memory freed) with exit 0."""
    port = free_port()
    output = Path(nodes.temp_dir) / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "elasticmoe.cli", "--log-level", "WARNING", "serve", "--address", nodes.address,
           "--port", str(port), *flags]
    with open(output, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=nodes.env)
    served = Served(f"http://127.0.0.1:{port}", proc, output)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, output.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not become ready: " + output.read_text()[-3000:]
            try:
                if httpx.get(f"{served.url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield served
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("the server did not stop on SIGTERM: " + output.read_text()[-3000:]) from None
        assert code == 0, output.read_text()[-3000:]
