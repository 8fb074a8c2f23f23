"""Emulated nodes on one machine: what a multi-node run needs from a cluster, made of Linux network
namespaces (root only). Each node is a namespace with its own address on one interface, `plait0`,
whose other end sits on a bridge in the host; `tc`'s token bucket (`tbf`) shapes that link to a
rate in both directions, so traffic between nodes crosses a slow link while processes on one node
talk over their namespace's loopback (its own addresses are local). Each node runs the command it
is given (torchrun, with a c10d rendezvous at node 0's address) with `GLOO_SOCKET_IFNAME=plait0`.

`EmulatedNodes` is a context manager that removes everything it made (processes, namespaces,
veth pairs, the bridge) whatever happens; `cleanup(prefix)` removes what a killed run left behind.
No delay is emulated (this machine's `tc` has no `netem`): links differ by rate only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

SUBNET = "10.87.0"  # node i is SUBNET.(i + 1)/24
IFNAME = "plait0"  # every node's interface has this name, so one GLOO_SOCKET_IFNAME fits all


class NodesUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, or no `ip`): the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str:
    """"" where emulated nodes can be made, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        probe = _ip("netns", "add", "plait-probe", check=False)
    except FileNotFoundError:
        return "no `ip` command (iproute2)"
    if probe.returncode:
        return f"ip netns add failed: {probe.stderr.strip()}"
    _ip("netns", "del", "plait-probe", check=False)
    return ""


def cleanup(prefix: str = "plait") -> None:
    """Remove the namespaces, veth pairs and bridge named by `prefix` (a run that was killed left
    them). A veth pair goes with either end: its host end is deleted here, as a namespace's
    deletion frees the other end only once the kernel lets the namespace go."""
    for line in _ip("-o", "link", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(f"{prefix}h") and name[len(prefix) + 1:].isdigit():
            _ip("link", "del", name, check=False)
    names = _ip("netns", "list", check=False).stdout.split()
    for name in names:
        if name.startswith(f"{prefix}-n"):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                _kill(int(pid))
            _ip("netns", "del", name, check=False)  # its veth ends, and their peers, go too
    _ip("link", "del", f"{prefix}br", check=False)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class EmulatedNodes:
    """`nodes` namespaces on a bridge, each link shaped to `rate_mbit` (None: unshaped)."""

    nodes: int
    rate_mbit: float | None = None
    prefix: str = "plait"
    processes: list = field(default_factory=list)

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def __enter__(self) -> EmulatedNodes:
        why = available()
        if why:
            raise NodesUnavailable(why)
        cleanup(self.prefix)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        bridge = f"{self.prefix}br"
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for i in range(self.nodes):
            ns, host_end = self.namespace(i), f"{self.prefix}h{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _ip("link", "set", host_end, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        if self.rate_mbit:
            self.set_rate(self.rate_mbit)

    def set_rate(self, rate_mbit: float) -> None:
        """Shape every node's link to `rate_mbit` from now on."""
        self.rate_mbit = rate_mbit
        for i in range(self.nodes):
            self._shape(["ip", "netns", "exec", self.namespace(i)], IFNAME)  # leaving the node
            self._shape([], f"{self.prefix}h{i}")  # arriving at it

    def _shape(self, prefix: list[str], dev: str) -> None:
        """A token bucket: `rate_mbit`, a burst of 1 ms of it (at least 64 KiB: a jumbo frame
        and more), packets waiting up to 100 ms."""
        burst = max(64 * 1024, int(self.rate_mbit * 1e6 / 8 / 1000))
        subprocess.run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                        f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "100ms"],
                       check=True, capture_output=True, text=True)

    def start(self, node: int, argv: list[str], env: dict | None = None, **kwargs
              ) -> subprocess.Popen:
        """`argv` in node `node`'s namespace, with gloo on its interface."""
        env = {**(env or os.environ), "GLOO_SOCKET_IFNAME": IFNAME}
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(node), *argv], env=env,
                                start_new_session=True, **kwargs)
        self.processes.append(proc)
        return proc

    def torchrun(self, node: int, nproc: int, args: list[str], port: int = 29500,
                 env: dict | None = None, nnodes: str = "", launcher: tuple[str, ...] = (),
                 rdzv_conf: str = "", **kwargs) -> subprocess.Popen:
        """torchrun for node `node` of a job on every node (`nnodes`: torchrun's, "MIN:MAX" for
        an elastic job; `launcher`: more of its options, `--max-restarts 1`; `rdzv_conf`: more of
        its rendezvous settings, "last_call_timeout=1"), its c10d store on node 0. (The
        rendezvous, not `node`, decides which ranks a node's processes get: consecutive ones.)"""
        conf = ",".join(c for c in (f"is_host={'true' if node == 0 else 'false'}", rdzv_conf) if c)
        return self.start(node, [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes or str(self.nodes),
            "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{self.address(0)}:{port}", "--rdzv-id", self.prefix,
            "--rdzv-conf", conf, *launcher,
            # The nodes share one host name; without its address a node would tell the others
            # to find the job's store at "localhost".
            "--local-addr", self.address(node), *args], env, **kwargs)

    def close(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        cleanup(self.prefix)

    def __exit__(self, *exc) -> None:
        self.close()
