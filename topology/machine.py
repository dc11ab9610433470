"""``Topology``: which expert-parallel ranks share a node, and how the GPUs of a node are linked.

A topology is a value: it prints as a table (``str(topo)``, ``python -m ep_comm.topology``), saves to and
loads from JSON, and compares equal when it describes the same machine. Three ways to get one:

- :func:`discover`: every process publishes its host name and its devices (with NVML, through the
  optional ``nvidia-ml-py`` package: GPU name, PCI bus id, NUMA node, NVLink peers, NICs on the same
  NUMA node); processes on the same host form a node. Collective when there are several processes.
- :func:`simulated`: ``N`` nodes of ``G`` devices, for tests and for planning on any machine.
- the ``EP_COMM_TOPOLOGY`` override, read by :func:`current`: ``"2x4"`` (simulated) or the path of a
  JSON file written by :meth:`Topology.save`.

Expert-parallel rank ``r`` of a topology with ``G`` devices per node sits on node ``r // G`` at
local index ``r % G`` (node-major order, the order ``jax.make_mesh`` and ``jax.devices()`` give on
multi-node machines). Results of hierarchical dispatch/combine do not depend on this mapping being
true -- only their speed does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
from typing import Sequence

import jax

from ep_comm.topology._checks import positive_int

ENV = "EP_COMM_TOPOLOGY"
LINK_CLASSES = ("self", "nvlink", "pcie", "network")


@dataclasses.dataclass(frozen=True)
class Device:
    """One device (GPU, or CPU device on CPU-only machines) of a node.

    Attributes:
      local_index: index on its node, ``0 .. G-1``.
      device_id: JAX global device id, ``None`` in a simulated topology.
      kind: ``"gpu"``, ``"cpu"`` or ``"simulated"``.
      name: product name (NVML) or JAX's device kind.
      pci_bus_id: PCI bus id (NVML), ``""`` when unknown.
      numa_node: NUMA node of the device's PCI slot, ``None`` when unknown.
      nvlink_peers: local indices of the devices it reaches over NVLink (directly or through
        NVSwitch: NVML's NVLink peer-to-peer status).
      nics: RDMA NICs on the same NUMA node (``/sys/class/infiniband``).
    """

    local_index: int
    device_id: int | None = None
    kind: str = "simulated"
    name: str = ""
    pci_bus_id: str = ""
    numa_node: int | None = None
    nvlink_peers: tuple[int, ...] = ()
    nics: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Node:
    """One node: its host name and its devices in local-index order."""

    host: str
    devices: tuple[Device, ...]


@dataclasses.dataclass(frozen=True)
class Topology:
    """The machine the expert-parallel axis runs on: ``nodes`` in rank order.

    ``source`` says where it came from (``"discovered"``, ``"simulated"`` or ``"file:<path>"``).
    """

    nodes: tuple[Node, ...]
    source: str = "simulated"

    def __post_init__(self):
        if not self.nodes:
            raise ValueError("Topology: nodes must not be empty")
        for i, node in enumerate(self.nodes):
            if not node.devices:
                raise ValueError(f"Topology: node {i} ({node.host!r}) has no devices")
            locs = [d.local_index for d in node.devices]
            if locs != list(range(len(locs))):
                raise ValueError(f"Topology: node {i} ({node.host!r}) must list local indices "
                                 f"0..{len(locs) - 1} in order, got {locs}")

    # Shape ---------------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Nodes (hosts) of the machine."""
        return len(self.nodes)

    @property
    def gpus_per_node(self) -> int:
        """Devices per node; raises when the nodes differ (the hierarchical plan needs equal
        nodes)."""
        sizes = {len(n.devices) for n in self.nodes}
        if len(sizes) != 1:
            raise ValueError(f"Topology: nodes have different device counts "
                             f"{[len(n.devices) for n in self.nodes]}; the hierarchical plan "
                             f"needs the same number of devices on every node")
        return sizes.pop()

    @property
    def num_ranks(self) -> int:
        """Devices of every node together: the ranks of an expert-parallel axis over it."""
        return sum(len(n.devices) for n in self.nodes)

    @property
    def shape(self) -> tuple[int, int]:
        """``(nodes, devices per node)``."""
        return self.num_nodes, self.gpus_per_node

    def node_of(self, rank: int) -> int:
        """The node holding ``rank`` (ranks are node-major: node ``rank // gpus_per_node``)."""
        return rank // self.gpus_per_node

    def intra_node_link(self) -> str:
        """Link class between devices of one node: ``"nvlink"`` when every pair of GPUs is NVLink
        peers (assumed for simulated nodes), else ``"pcie"``."""
        for node in self.nodes:
            for d in node.devices:
                if d.kind == "simulated":
                    continue
                others = {o.local_index for o in node.devices} - {d.local_index}
                if d.kind != "gpu" or not others <= set(d.nvlink_peers):
                    return "pcie"
        return "nvlink"

    def link(self, src: int, dst: int) -> str:
        """Link class a message from rank ``src`` to rank ``dst`` crosses."""
        if src == dst:
            return "self"
        if self.node_of(src) != self.node_of(dst):
            return "network"
        return self.intra_node_link()

    def check_ranks(self, num_ranks: int, owner: str = "Topology") -> None:
        """Raise ``ValueError`` (worded for ``owner``) unless the topology has ``num_ranks``
        ranks."""
        if self.num_ranks != num_ranks:
            raise ValueError(f"{owner}: the topology has {self.num_nodes} nodes x "
                             f"{self.gpus_per_node} devices = {self.num_ranks} ranks but the "
                             f"expert-parallel axis has {num_ranks}")

    # Serialisation -------------------------------------------------------------------------------
    def to_json(self) -> str:
        """The topology as JSON text (:meth:`from_json` reads it back)."""
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, source: str | None = None) -> "Topology":
        """The topology in JSON ``text`` (as :meth:`to_json` writes it); a malformed text raises
        ``ValueError`` naming ``source``."""
        try:
            raw = json.loads(text)
            nodes = tuple(Node(n["host"], tuple(
                Device(**{**d, "nvlink_peers": tuple(d.get("nvlink_peers", ())),
                          "nics": tuple(d.get("nics", ()))}) for d in n["devices"]))
                for n in raw["nodes"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"Topology.from_json: not a saved topology ({type(e).__name__}: "
                             f"{e})") from None
        return cls(nodes, source if source is not None else raw.get("source", "file"))

    def save(self, path) -> None:
        """Write the topology to the file ``path`` as JSON (``EP_COMM_TOPOLOGY`` can name it)."""
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path) -> "Topology":
        """The topology saved in the file ``path`` (:meth:`save`)."""
        with open(path) as f:
            return cls.from_json(f.read(), source=f"file:{path}")

    def __str__(self) -> str:
        try:
            shape = f"{self.num_nodes} nodes x {self.gpus_per_node} devices"
        except ValueError:
            shape = f"{self.num_nodes} nodes, {self.num_ranks} devices"
        lines = [f"Topology ({self.source}): {shape}, intra-node link {self.intra_node_link()}, "
                 f"inter-node link network"]
        lines.append(f"{'rank':>4} {'node':>4} {'local':>5}  {'host':<16} {'device':>6}  "
                     f"{'name':<24} {'pci':<14} {'numa':>4}  nvlink peers / nics")
        rank = 0
        for i, node in enumerate(self.nodes):
            for d in node.devices:
                dev = "-" if d.device_id is None else str(d.device_id)
                numa = "-" if d.numa_node is None else str(d.numa_node)
                peers = ",".join(map(str, d.nvlink_peers)) or "-"
                nics = ",".join(d.nics) or "-"
                lines.append(f"{rank:>4} {i:>4} {d.local_index:>5}  {node.host[:16]:<16} "
                             f"{dev:>6}  {(d.name or d.kind)[:24]:<24} {d.pci_bus_id[:14]:<14} "
                             f"{numa:>4}  {peers} / {nics}")
                rank += 1
        return "\n".join(lines)


def simulated(num_nodes: int, gpus_per_node: int) -> Topology:
    """``num_nodes`` nodes of ``gpus_per_node`` NVLink-connected devices (no real devices)."""
    positive_int("simulated", "num_nodes", num_nodes)
    positive_int("simulated", "gpus_per_node", gpus_per_node)
    peers = tuple(range(gpus_per_node))
    return Topology(tuple(
        Node(f"node{a}", tuple(Device(g, nvlink_peers=tuple(p for p in peers if p != g))
                               for g in range(gpus_per_node)))
        for a in range(num_nodes)), "simulated")


def parse(spec: str) -> Topology:
    """``"NxG"`` (simulated) or the path of a saved topology (JSON)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"topology spec must be 'NxG' (e.g. '2x4') or a JSON file path, "
                         f"got {spec!r}")
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", spec)
    if m:
        n, g = int(m.group(1)), int(m.group(2))
        if n < 1 or g < 1:
            raise ValueError(f"topology spec {spec!r}: nodes and devices per node must be >= 1")
        return simulated(n, g)
    if os.path.exists(spec):
        return Topology.load(spec)
    raise ValueError(f"topology spec must be 'NxG' (e.g. '2x4') or a JSON file path, got "
                     f"{spec!r} (no such file)")


# Discovery ---------------------------------------------------------------------------------------
def _nics_by_numa() -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    base = "/sys/class/infiniband"
    if not os.path.isdir(base):
        return out
    for nic in sorted(os.listdir(base)):
        try:
            with open(os.path.join(base, nic, "device", "numa_node")) as f:
                out.setdefault(int(f.read().strip()), []).append(nic)
        except (OSError, ValueError):
            continue
    return out


def _nvml_devices(ordinals: Sequence[int]) -> tuple[list[dict], str]:
    """NVML facts for CUDA ordinals (the process's visible devices); ``([], why)`` without NVML."""
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [], f"NVML unavailable ({e})"
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        phys = list(ordinals)
        if visible and all(v.strip().isdigit() for v in visible.split(",")):
            vis = [int(v) for v in visible.split(",")]
            phys = [vis[o] for o in ordinals]
        every = [pynvml.nvmlDeviceGetHandleByIndex(i)
                 for i in range(pynvml.nvmlDeviceGetCount())]  # NVML sees every GPU of the host

        def text(v):
            return v.decode() if isinstance(v, bytes) else v

        nics = _nics_by_numa()
        out = []
        for i in phys:
            h = every[i]
            bus = text(pynvml.nvmlDeviceGetPciInfo(h).busId)
            numa = None
            try:
                with open(f"/sys/bus/pci/devices/{bus.lower()[-12:]}/numa_node") as f:
                    numa = int(f.read().strip())
                numa = None if numa < 0 else numa
            except (OSError, ValueError):
                pass
            peers = []  # PCI bus ids of the host's GPUs this one reaches over NVLink
            for j, other in enumerate(every):
                if j == i:
                    continue
                try:
                    st = pynvml.nvmlDeviceGetP2PStatus(h, other, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                except pynvml.NVMLError:
                    continue
                if st == pynvml.NVML_P2P_STATUS_OK:
                    peers.append(text(pynvml.nvmlDeviceGetPciInfo(other).busId))
            out.append(dict(name=text(pynvml.nvmlDeviceGetName(h)), pci_bus_id=bus,
                            numa_node=numa, nvlink_peer_buses=peers,
                            nics=nics.get(numa, []) if numa is not None else []))
        return out, ""
    finally:
        pynvml.nvmlShutdown()


def _local_description() -> dict:
    devs = sorted(jax.local_devices(), key=lambda d: d.id)
    desc = [dict(device_id=d.id, kind="gpu" if d.platform in ("gpu", "cuda", "rocm") else "cpu",
                 name=getattr(d, "device_kind", d.platform)) for d in devs]
    note = ""
    if desc and desc[0]["kind"] == "gpu":
        facts, note = _nvml_devices([getattr(d, "local_hardware_id", i) or i
                                     for i, d in enumerate(devs)])
        for d, f in zip(desc, facts):
            d.update(f)
    return dict(host=socket.gethostname(), process=jax.process_index(), devices=desc, note=note)


def discover() -> Topology:
    """Discover the machine: one node per host, its devices in (process, device id) order.

    Collective when ``jax.process_count() > 1`` (every process must call it; it gathers over the
    ``jax.distributed`` key-value store, or mpi4py with ``EP_COMM_BOOTSTRAP=mpi``). NVLink, PCI,
    NUMA and NIC facts need ``nvidia-ml-py``; without it the devices are listed without them and
    the intra-node link class is taken to be PCIe.
    """
    from ep_comm.topology.processes import process_allgather

    infos = process_allgather(_local_description(), what="topology")
    hosts: dict[str, list[dict]] = {}
    for info in sorted(infos, key=lambda i: i["process"]):
        hosts.setdefault(info["host"], []).extend(info["devices"])
    nodes = []
    for host, devs in hosts.items():
        local_of_bus = {d["pci_bus_id"]: g for g, d in enumerate(devs) if d.get("pci_bus_id")}
        built = []
        for g, d in enumerate(devs):
            peers = sorted(local_of_bus[b] for b in d.get("nvlink_peer_buses", ())
                           if b in local_of_bus)
            built.append(Device(g, d["device_id"], d["kind"], d.get("name", ""),
                                d.get("pci_bus_id", ""), d.get("numa_node"), tuple(peers),
                                tuple(d.get("nics", ()))))
        nodes.append(Node(host, tuple(built)))
    notes = sorted({i["note"] for i in infos if i["note"]})
    return Topology(tuple(nodes), "discovered" + (f" ({'; '.join(notes)})" if notes else ""))


_CACHE: dict = {}


def known() -> Topology | None:
    """What is known without a collective call: the ``EP_COMM_TOPOLOGY`` override, else the
    topology :func:`current` discovered earlier, else ``None``."""
    spec = os.environ.get(ENV)
    if spec:
        return parse(spec)
    return _CACHE.get("discovered")


def current(refresh: bool = False) -> Topology:
    """The topology ep_comm plans with: ``EP_COMM_TOPOLOGY`` when set, else :func:`discover`
    (cached; ``refresh=True`` discovers again)."""
    spec = os.environ.get(ENV)
    if spec:
        return parse(spec)
    if refresh or "discovered" not in _CACHE:
        _CACHE["discovered"] = discover()
    return _CACHE["discovered"]
