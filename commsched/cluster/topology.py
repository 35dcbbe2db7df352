"""The cluster's topology: which host each rank is on, the link classes between ranks, and
the graph of ranks, host fabrics, NICs and the switch that a pair's traffic crosses; and
the exchange-time prediction made from it.

Legend: P ranks, H hosts; ``_P`` one entry per rank, ``_PP`` one per (source,
destination) rank pair; a *link* is one directed edge ``(u, v)`` of the graph.

The graph (a networkx ``DiGraph``; every edge is one direction of one link):

``("rank", r) -> ("bus", h)`` and back
    rank r's port onto the fabric of its host h (NVLink, shared memory, loopback): link
    class ``intra``; present when h has two or more ranks.
``("rank", r) -> ("nic", h)`` and back
    the way from a rank to its host's NIC: class ``attach``, not a limit (PCIe is not
    modelled); present when there are two or more hosts.
``("nic", h) -> ("switch",)`` / ``("switch",) -> ("nic", h)``
    host h's NIC, sending / receiving: class ``inter``. Every rank of h sends its
    traffic to other hosts through the one outgoing edge, and receives through the one
    incoming edge (full duplex, as the emulated hosts of ``commsched netem`` are).

An intra-host pair crosses ``rank -> bus -> rank``; an inter-host pair ``rank -> nic ->
switch -> nic -> rank``. Each link class has one alpha-beta cost (``LinkCost``: latency
gamma, seconds per byte theta); a probed topology also holds each pair's own cost alone.

:func:`predict_exchange` charges a pair's bytes to every link on its path; a link's time
is its class latency plus its bytes at its rate; the exchange takes as long as its busiest
link, or as its slowest pair alone when that is longer (docs/topology.md).

Everything here is pure except :meth:`Topology.from_env` and :meth:`Topology.probe`,
which are collectives on a process group (torch is imported only when they are called).
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from .._lazy import require
from .costmodel import LinkCost

if TYPE_CHECKING:  # networkx is imported where the graph is built (not at import)
    import networkx as nx

INTRA = "intra"    # within a host: rank <-> host fabric
INTER = "inter"    # between hosts: a host's NIC <-> the switch
ATTACH = "attach"  # rank <-> its host's NIC: not a limit
LINK_CLASSES = (INTRA, INTER)

Node = tuple  # ("rank", r) | ("bus", host) | ("nic", host) | ("switch",)
Link = tuple  # (Node, Node): one direction of one link
SWITCH: Node = ("switch",)

# what a hand-built topology assumes when it is not told (a placeholder for drawings and
# what-if sums, not a measurement: probe a real group for that)
DEFAULT_INTRA = LinkCost(gamma=3e-6, theta=1 / 200e9)    # 3 us, 200 GB/s (1600 Gbit/s)
DEFAULT_INTER = LinkCost(gamma=10e-6, theta=1 / 12.5e9)  # 10 us, 12.5 GB/s (100 Gbit/s)
# the probe's message sizes: one small (the latency), the others large enough that a
# token bucket's burst (62.5 KB on an emulated 1 Gbit/s link) does not set the rate: with
# 64 KiB among them the fit read 1.15-1.47 Gbit/s on a 1 Gbit/s link, without it 0.92-0.96
# (docs/topology.md)
PROBE_SIZES = (1 << 12, 1 << 20, 1 << 22, 1 << 24)
FILE_KEYS = ("ranks", "links", "pairs", "source")
LINK_KEYS = ("latency_us", "rate", "rate_Bps")


def _check_cost(c: Any, what: str) -> LinkCost:
    if not isinstance(c, LinkCost):
        raise TypeError(f"{what} must be a commsched.LinkCost, got {type(c).__name__}")
    for name in ("gamma", "theta"):
        v = getattr(c, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{what}.{name} must be a finite number >= 0, got {v!r}")
    return c


@dataclass(frozen=True)
class Topology:
    """Ranks on hosts, one ``LinkCost`` per link class, optional per-pair costs.

    ``hosts_P[r]`` is the host of rank r (ranks are those of the group it describes).
    ``links`` maps ``"intra"`` / ``"inter"`` to the cost of one link of that class; a
    class that the layout uses must be there (``intra`` when a host has two or more ranks,
    ``inter`` when there are two or more hosts), others may be left out. ``pairs`` maps
    (src, dst) to that pair's own cost when it is the only traffic on its links (a probe
    fills it: each pair is timed alone); :meth:`pair_cost` falls back to the class. ``source`` says where it came
    from (``hand-built``, ``file``, ``env``, ``probe``).
    """

    hosts_P: tuple[str, ...]
    links: Mapping[str, LinkCost]
    pairs: Mapping[tuple[int, int], LinkCost] = field(default_factory=dict)
    source: str = "hand-built"
    _graph: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        hosts = tuple(self.hosts_P) if not isinstance(self.hosts_P, str) else None
        if not hosts:
            raise ValueError(f"hosts_P must be a non-empty sequence of host names, one per rank, "
                             f"got {self.hosts_P!r}")
        for r, h in enumerate(hosts):
            if not isinstance(h, str) or not h:
                raise ValueError(f"hosts_P[{r}] must be a non-empty host name, got {h!r}")
        if not isinstance(self.links, Mapping):
            raise TypeError(f"links must map link classes {LINK_CLASSES} to LinkCost, "
                            f"got {type(self.links).__name__}")
        links = {}
        for k, c in self.links.items():
            if k not in LINK_CLASSES:
                raise ValueError(f"unknown link class {k!r}; the classes are {LINK_CLASSES}")
            links[k] = _check_cost(c, f"links[{k!r}]")
        P = len(hosts)
        pairs = {}
        for key, c in dict(self.pairs).items():
            if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(x, int) for x in key)):
                raise ValueError(f"pairs keys must be (src, dst) rank pairs, got {key!r}")
            a, b = key
            if not (0 <= a < P and 0 <= b < P) or a == b:
                raise ValueError(f"pairs[{key}]: a pair is two different ranks in 0..{P - 1}")
            pairs[(a, b)] = _check_cost(c, f"pairs[{key}]")
        needed = used_classes(hosts)
        missing = [k for k in needed if k not in links]
        if missing:
            raise ValueError(f"links has no cost for link class {missing[0]!r}, which this layout "
                             f"({P} ranks on {len(set(hosts))} hosts) uses; give links[{missing[0]!r}]")
        object.__setattr__(self, "hosts_P", hosts)
        object.__setattr__(self, "links", MappingProxyType(links))
        object.__setattr__(self, "pairs", MappingProxyType(dict(sorted(pairs.items()))))
        object.__setattr__(self, "_graph", _build_graph(hosts, links))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hosts(cls, hosts_P: Sequence[str], *, intra: LinkCost = DEFAULT_INTRA,
                   inter: LinkCost = DEFAULT_INTER, source: str = "hand-built") -> "Topology":
        """Rank r on host ``hosts_P[r]``; link classes ``intra`` / ``inter`` (defaults:
        :data:`DEFAULT_INTRA`, :data:`DEFAULT_INTER`, placeholders, not measurements); a
        class the layout does not use is left out."""
        given = {INTRA: intra, INTER: inter}
        return cls(tuple(hosts_P), {k: given[k] for k in used_classes(hosts_P)}, source=source)

    @classmethod
    def grid(cls, hosts: int, ranks_per_host: int, **kw: Any) -> "Topology":
        """``hosts`` hosts named host0, host1, ... with ``ranks_per_host`` consecutive ranks
        each (torchrun's numbering); ``kw`` as :meth:`from_hosts`."""
        for name, v in (("hosts", hosts), ("ranks_per_host", ranks_per_host)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        return cls.from_hosts([f"host{r // ranks_per_host}" for r in range(hosts * ranks_per_host)], **kw)

    @classmethod
    def from_pair_costs(cls, hosts_P: Sequence[str], alone: Mapping[tuple[int, int], LinkCost],
                        *, source: str = "probe") -> "Topology":
        """The topology of a probe: ``alone[(a, b)]`` is pair (a, b)'s cost with no other
        traffic on its links; each class costs the median of its pairs
        (:func:`fit_link_classes`)."""
        return cls(tuple(hosts_P), fit_link_classes(hosts_P, alone), alone, source=source)

    @classmethod
    def from_env(cls, group=None, *, intra: LinkCost = DEFAULT_INTRA,
                 inter: LinkCost = DEFAULT_INTER) -> "Topology":
        """The hosts of ``group``'s ranks, learnt with one all_gather of each rank's host
        name and torchrun's node index (``GROUP_RANK``; emulated hosts share one host name);
        link costs as :meth:`from_hosts`. Collective: every rank of ``group`` calls it."""
        import torch.distributed as dist

        from ..config import read_env
        from ..dist import all_gather_object

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("Topology.from_env and Topology.probe are collectives over a process "
                             "group: call commsched.init_distributed() first (under torchrun), or "
                             "build the topology with Topology.from_hosts / Topology.load")
        me = (socket.gethostname(), read_env().group_rank)
        gathered = all_gather_object(me, "gathering host names for the topology", group)
        return cls.from_hosts(host_names(gathered), intra=intra, inter=inter, source="env")

    @classmethod
    def probe(cls, group=None, *, sizes: Sequence[int] = PROBE_SIZES, repeats: int = 3,
              device=None) -> "Topology":
        """Hosts as :meth:`from_env`, costs measured: every ordered pair timed alone
        (``probe_pair_costs`` over :func:`probe_rounds`, a fit per pair over ``sizes``),
        then :meth:`from_pair_costs`. Collective; every rank gets the same topology."""
        from .costmodel import probe_pair_costs

        layout = cls.from_env(group)
        alone = probe_pair_costs(probe_rounds(layout), group, sizes=sizes, repeats=repeats,
                                 device=device)
        return cls.from_pair_costs(layout.hosts_P, alone)

    # ------------------------------------------------------------------ queries
    @property
    def world_size(self) -> int:
        return len(self.hosts_P)

    @property
    def hosts(self) -> tuple[str, ...]:
        """Host names in order of their first rank."""
        return tuple(dict.fromkeys(self.hosts_P))

    @property
    def graph(self) -> "nx.DiGraph":
        """A read-only view of the graph; edges carry ``cls``, ``latency_s``, ``rate_Bps``."""
        return self._graph.copy(as_view=True)

    def ranks_of(self, host: str) -> list[int]:
        if host not in self.hosts:
            raise ValueError(f"no host {host!r}; the hosts are {list(self.hosts)}")
        return [r for r, h in enumerate(self.hosts_P) if h == host]

    def _rank(self, r: Any, what: str = "rank") -> int:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < self.world_size:
            raise ValueError(f"{what} must be a rank in 0..{self.world_size - 1}, got {r!r}")
        return r

    def host_of(self, r: int) -> str:
        return self.hosts_P[self._rank(r)]

    def link_class(self, a: int, b: int) -> str:
        """``intra`` when ranks a and b share a host, else ``inter``."""
        self._pair(a, b)
        return INTRA if self.hosts_P[a] == self.hosts_P[b] else INTER

    def _pair(self, a: int, b: int) -> None:
        self._rank(a, "src")
        self._rank(b, "dst")
        if a == b:
            raise ValueError(f"rank {a} to itself crosses no link (a local copy)")

    def path(self, a: int, b: int) -> list[Link]:
        """The links that traffic from rank a to rank b crosses, in order."""
        self._pair(a, b)
        ha, hb = self.hosts_P[a], self.hosts_P[b]
        if ha == hb:
            nodes = [("rank", a), ("bus", ha), ("rank", b)]
        else:
            nodes = [("rank", a), ("nic", ha), SWITCH, ("nic", hb), ("rank", b)]
        return list(zip(nodes[:-1], nodes[1:]))

    def link_cost(self, link: Link) -> LinkCost | None:
        """The cost of one link of the graph; None for an ``attach`` link (no limit)."""
        if not self._graph.has_edge(*link):
            raise ValueError(f"{link!r} is not a link of this topology")
        cls = self._graph.edges[link]["cls"]
        return None if cls == ATTACH else self.links[cls]

    def pair_cost(self, a: int, b: int) -> LinkCost:
        """The cost of sending from a to b with nothing else on the way: the probed pair's
        own cost when there is one, else its link class's."""
        cls = self.link_class(a, b)
        return self.pairs.get((a, b), self.links[cls])

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        """The file form (see docs/topology.md); :meth:`from_dict` reads it back."""
        def cost(c: LinkCost) -> dict[str, Any]:
            return {"latency_us": c.gamma * 1e6,
                    "rate_Bps": None if c.theta == 0 else 1.0 / c.theta}

        return {"ranks": list(self.hosts_P),
                "links": {k: cost(c) for k, c in self.links.items()},
                "pairs": [{"src": a, "dst": b, **cost(c)} for (a, b), c in self.pairs.items()],
                "source": self.source}

    @classmethod
    def from_dict(cls, d: Any, where: str = "topology") -> "Topology":
        """Read the file form; a malformed one is one ValueError naming the field."""
        def bad(fld: str, msg: str) -> ValueError:
            return ValueError(f"{where}: {fld}: {msg}")

        if not isinstance(d, dict):
            raise bad("<top>", f"expected an object with keys {list(FILE_KEYS)}, got {type(d).__name__}")
        extra = sorted(set(d) - set(FILE_KEYS))
        if extra:
            raise bad(extra[0], f"unknown key; the keys are {list(FILE_KEYS)}")
        if "ranks" not in d:
            raise bad("ranks", "missing: give the host name of every rank, e.g. "
                      '["node-a", "node-a", "node-b", "node-b"]')
        ranks = d["ranks"]
        if not isinstance(ranks, list) or not ranks:
            raise bad("ranks", f"expected a non-empty list of host names, got {ranks!r}")
        for r, h in enumerate(ranks):
            if not isinstance(h, str) or not h:
                raise bad(f"ranks[{r}]", f"expected a non-empty host name, got {h!r}")
        links_d = d.get("links", {})
        if not isinstance(links_d, dict):
            raise bad("links", f"expected an object of link classes {list(LINK_CLASSES)}, got {links_d!r}")
        links = {}
        for k, v in links_d.items():
            if k not in LINK_CLASSES:
                raise bad(f"links.{k}", f"unknown link class; the classes are {list(LINK_CLASSES)}")
            links[k] = _read_cost(v, f"links.{k}", bad)
        pairs_d = d.get("pairs", [])
        if not isinstance(pairs_d, list):
            raise bad("pairs", f"expected a list of {{src, dst, latency_us, rate}} objects, got {pairs_d!r}")
        pairs = {}
        for i, p in enumerate(pairs_d):
            fld = f"pairs[{i}]"
            if not isinstance(p, dict):
                raise bad(fld, f"expected an object, got {p!r}")
            ends = []
            for e in ("src", "dst"):
                v = p.get(e)
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < len(ranks):
                    raise bad(f"{fld}.{e}", f"expected a rank in 0..{len(ranks) - 1}, got {v!r}")
                ends.append(v)
            if ends[0] == ends[1]:
                raise bad(fld, f"src and dst are both rank {ends[0]}; a pair is two different ranks")
            if tuple(ends) in pairs:
                raise bad(fld, f"pair {tuple(ends)} is given twice")
            pairs[tuple(ends)] = _read_cost({k: v for k, v in p.items() if k not in ("src", "dst")},
                                            fld, bad)
        source = d.get("source", "file")
        if not isinstance(source, str):
            raise bad("source", f"expected a string, got {source!r}")
        try:
            return cls(tuple(ranks), links, pairs, source=source)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Topology":
        """Read a topology file (JSON, docs/topology.md); one ValueError naming the file and
        the field for a malformed one."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read topology file {path}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"topology file {path}: not UTF-8 text (byte {e.start}: "
                             f"{e.object[e.start:e.start + 1]!r}); a topology file is JSON "
                             "(docs/topology.md)") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None
        t = cls.from_dict(d, where=str(path))
        return t

    # ------------------------------------------------------------------ showing
    def table(self) -> str:
        """The topology in words: hosts and their ranks, link classes, per-pair costs."""
        lines = [f"topology: {self.world_size} ranks on {len(self.hosts)} host(s) ({self.source})", "",
                 f"{'host':<16} ranks"]
        for h in self.hosts:
            lines.append(f"{h:<16} {_ranges(self.ranks_of(h))}")
        lines += ["", f"{'link class':<11} {'crossed by':<34} {'latency':>11} {'rate':>14}"]
        where = {INTRA: "rank -> host fabric -> rank", INTER: "rank -> NIC -> switch -> NIC -> rank"}
        for k, c in self.links.items():
            lines.append(f"{k:<11} {where[k]:<34} {_us(c.gamma):>11} {_rate(c.theta):>14}")
        if self.pairs:
            P = self.world_size
            lines += ["", "pairs (src row -> dst column), each alone: rate; latency"]
            lines.append("       " + "".join(f"{b:>22}" for b in range(P)))
            for a in range(P):
                cells = []
                for b in range(P):
                    c = self.pairs.get((a, b))
                    cells.append("-" if c is None else f"{_rate(c.theta)}; {_us(c.gamma)}")
                lines.append(f"{a:>6} " + "".join(f"{x:>22}" for x in cells))
        return "\n".join(lines)

    def draw(self, path: str | os.PathLike) -> Path:
        """A picture of the graph (PNG, matplotlib's Agg backend): the switch on top, each
        host's NIC and fabric below it, its ranks at the bottom; links coloured by class."""
        matplotlib = require("matplotlib", "the picture of a topology (topology.png)")
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import networkx as nx

        g = self._graph.to_undirected(as_view=False)
        pos, width = _positions(self)
        fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * width + 1.5), 4.5))
        colors = {INTRA: "tab:green", INTER: "tab:red", ATTACH: "lightgray"}
        for cls in (ATTACH, INTRA, INTER):
            edges = [(u, v) for u, v, c in g.edges(data="cls") if c == cls]
            if not edges:
                continue
            label = "rank - NIC (no limit)" if cls == ATTACH else (f"{cls}: {_rate(self.links[cls].theta)}, "
                                               f"{_us(self.links[cls].gamma)}")
            nx.draw_networkx_edges(g, pos, edgelist=edges, edge_color=colors[cls],
                                   width=1.0 if cls == ATTACH else 2.5, ax=ax, label=label)
        shapes = {"rank": ("o", "tab:blue"), "bus": ("s", "tab:green"), "nic": ("D", "tab:red"),
                  "switch": ("h", "black")}
        for kind, (marker, color) in shapes.items():
            nodes = [n for n in g if n[0] == kind]
            if nodes:
                nx.draw_networkx_nodes(g, pos, nodelist=nodes, node_shape=marker, node_color=color,
                                       node_size=380 if kind == "rank" else 300, ax=ax)
        labels = {n: (str(n[1]) if n[0] == "rank" else "switch" if n == SWITCH else
                      f"{n[1]} {'NIC' if n[0] == 'nic' else 'fabric'}") for n in g}
        nx.draw_networkx_labels(g, {n: (x, y - 0.28) if n[0] != "rank" else (x, y) for n, (x, y) in pos.items()},
                                labels, font_size=8, ax=ax,
                                font_color="black")
        ax.set_title(f"{self.world_size} ranks on {len(self.hosts)} host(s) ({self.source})")
        ax.legend(loc="upper left", fontsize="small")
        ax.set_axis_off()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


# --------------------------------------------------------------------------- graph
def used_classes(hosts_P: Sequence[str]) -> list[str]:
    """The link classes a layout has: ``intra`` when a host has two or more ranks,
    ``inter`` when there are two or more hosts. Pure."""
    hosts = list(hosts_P)
    out = [INTRA] if len(set(hosts)) < len(hosts) else []
    return out + ([INTER] if len(set(hosts)) > 1 else [])


def _build_graph(hosts_P: Sequence[str], links: Mapping[str, LinkCost]) -> "nx.DiGraph":
    import networkx as nx

    g = nx.DiGraph()
    hosts = list(dict.fromkeys(hosts_P))

    def add(u: Node, v: Node, cls: str) -> None:
        c = links.get(cls)
        attrs = {"cls": cls, "latency_s": 0.0 if c is None else c.gamma,
                 "rate_Bps": math.inf if c is None else c.bandwidth_Bps}
        g.add_edge(u, v, **attrs)
        g.add_edge(v, u, **attrs)

    for r in range(len(hosts_P)):
        g.add_node(("rank", r), host=hosts_P[r])
    for h in hosts:
        ranks = [r for r, x in enumerate(hosts_P) if x == h]
        if len(ranks) > 1:
            for r in ranks:
                add(("rank", r), ("bus", h), INTRA)
        if len(hosts) > 1:
            for r in ranks:
                add(("rank", r), ("nic", h), ATTACH)
            add(("nic", h), SWITCH, INTER)
    return g


def _positions(t: Topology) -> tuple[dict[Node, tuple[float, float]], int]:
    pos: dict[Node, tuple[float, float]] = {}
    x = 0.0
    centres = []
    for h in t.hosts:
        ranks = t.ranks_of(h)
        xs = [x + i for i in range(len(ranks))]
        for r, xr in zip(ranks, xs):
            pos[("rank", r)] = (xr, 0.0)
        mid = sum(xs) / len(xs)
        if ("bus", h) in t._graph:
            pos[("bus", h)] = (mid - 0.25, 1.0)
        if ("nic", h) in t._graph:
            pos[("nic", h)] = (mid + 0.25, 2.0)
        centres.append(mid)
        x += len(ranks) + 1.0
    if SWITCH in t._graph:
        pos[SWITCH] = (sum(centres) / len(centres), 3.0)
    return pos, int(x)


# --------------------------------------------------------------------------- probe -> classes
def probe_rounds(t: Topology) -> list[list[tuple[int, int]]]:
    """Every ordered pair of ranks, packed into rounds in which no rank is in two pairs and
    no limiting link (a fabric port, a NIC direction) carries two pairs, so each pair of a
    round is timed alone. Greedy first fit, inter-host pairs first; pure."""
    P = t.world_size
    pairs = sorted(((a, b) for a in range(P) for b in range(P) if a != b),
                   key=lambda ab: (t.link_class(*ab) != INTER, (ab[1] - ab[0]) % P, ab[0]))
    rounds: list[list[tuple[int, int]]] = []
    busy: list[set] = []
    for a, b in pairs:
        need = {("rank", a), ("rank", b)} | {link for link in t.path(a, b)
                                             if t._graph.edges[link]["cls"] != ATTACH}
        for rnd, used in zip(rounds, busy):
            if not need & used:
                rnd.append((a, b))
                used |= need
                break
        else:
            rounds.append([(a, b)])
            busy.append(set(need))
    return rounds


def fit_link_classes(hosts_P: Sequence[str], alone: Mapping[tuple[int, int], LinkCost]
                     ) -> dict[str, LinkCost]:
    """One cost per link class from pairs each timed alone: the median over the class's
    pairs of their latency, and of their seconds per byte. Pure; a class with no pair is
    left out (the Topology then says which class is missing)."""
    shape = Topology.from_hosts(tuple(hosts_P))  # the layout only
    links: dict[str, LinkCost] = {}
    for cls in LINK_CLASSES:
        mine = [_check_cost(c, f"pair {ab}") for ab, c in alone.items() if shape.link_class(*ab) == cls]
        if mine:
            links[cls] = LinkCost(gamma=statistics.median(c.gamma for c in mine),
                                  theta=statistics.median(c.theta for c in mine))
    return links


def host_names(gathered: Iterable[tuple[str, int | None]]) -> tuple[str, ...]:
    """Host names per rank from each rank's (host name, torchrun node index). Pure.

    Ranks with the same host name and node index share a host. When hosts are told apart
    only by the node index (emulated hosts share the machine's name) the name is
    ``NAME#INDEX``; otherwise the host name alone.
    """
    keys = [(str(h), g) for h, g in gathered]
    distinct = list(dict.fromkeys(keys))
    if len({h for h, _ in distinct}) == len(distinct):
        return tuple(h for h, _ in keys)
    return tuple(h if g is None else f"{h}#{g}" for h, g in keys)


# --------------------------------------------------------------------------- prediction
@dataclass(frozen=True)
class ExchangePrediction:
    """What :func:`predict_exchange` found. ``link_bytes[l]`` and ``link_time_s[l]`` for
    every link of the graph (0 for an idle link), the ``busiest`` link (None when nothing
    is sent), the slowest pair alone (``slowest_pair``, ``pair_time_s``) and ``time_s``,
    the predicted time of the exchange."""

    link_bytes: Mapping[Link, float]
    link_time_s: Mapping[Link, float]
    busiest: Link | None
    slowest_pair: tuple[int, int] | None
    pair_time_s: float
    time_s: float


def predict_exchange(topology: Topology, bytes_PP: Any) -> ExchangePrediction:
    """Predict an exchange's time on ``topology``. Pure.

    ``bytes_PP[a][b]`` is the bytes rank a sends rank b (a P x P nested sequence, array or
    tensor; the diagonal is a local copy and crosses no link). Every pair's bytes load
    every link on its path, so a host's outgoing NIC edge carries all its ranks' traffic
    to other hosts. A link with B > 0 bytes takes ``gamma + B * theta`` of its class; the
    exchange takes the longer of its busiest link's time and the slowest pair's time alone
    (``pair_cost(a, b).time_s(bytes)``, which matters when probed pairs are slower than
    their class).
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a commsched.Topology, got {type(topology).__name__}")
    P = topology.world_size
    try:
        rows = [[float(x) for x in row] for row in bytes_PP]
    except (TypeError, ValueError):
        raise ValueError(f"bytes_PP must be a {P} x {P} table of byte counts") from None
    if len(rows) != P or any(len(row) != P for row in rows):
        raise ValueError(f"bytes_PP must be {P} x {P} (one row and column per rank of the "
                         f"topology), got {len(rows)} rows of lengths {sorted({len(r) for r in rows})}")
    for a, row in enumerate(rows):
        for b, x in enumerate(row):
            if not (math.isfinite(x) and x >= 0):
                raise ValueError(f"bytes_PP[{a}][{b}] must be a finite byte count >= 0, got {x}")
    g = topology._graph
    load: dict[Link, float] = {e: 0.0 for e in g.edges}
    slowest, pair_t = None, 0.0
    for a in range(P):
        for b in range(P):
            nb = rows[a][b]
            if a == b or nb == 0:
                continue
            for link in topology.path(a, b):
                load[link] += nb
            t = topology.pair_cost(a, b).time_s(nb)
            if t > pair_t:
                slowest, pair_t = (a, b), t
    times: dict[Link, float] = {}
    for link, nb in load.items():
        c = topology.link_cost(link)
        times[link] = 0.0 if nb == 0 or c is None else c.time_s(nb)
    busiest = None
    for link in sorted(times, key=str):
        if times[link] > 0 and (busiest is None or times[link] > times[busiest]):
            busiest = link
    link_t = times[busiest] if busiest is not None else 0.0
    return ExchangePrediction(MappingProxyType(load), MappingProxyType(times), busiest,
                              slowest, pair_t, max(link_t, pair_t))


# --------------------------------------------------------------------------- file helpers
def _read_cost(v: Any, fld: str, bad) -> LinkCost:
    from .netem import parse_optional_rate

    if not isinstance(v, dict):
        raise bad(fld, f"expected an object with latency_us and rate (or rate_Bps), got {v!r}")
    extra = sorted(set(v) - set(LINK_KEYS))
    if extra:
        raise bad(f"{fld}.{extra[0]}", f"unknown key; a link has {list(LINK_KEYS)}")
    lat = v.get("latency_us", 0.0)
    if not isinstance(lat, (int, float)) or isinstance(lat, bool) or not (math.isfinite(lat) and lat >= 0):
        raise bad(f"{fld}.latency_us", f"expected a number of microseconds >= 0, got {lat!r}")
    if ("rate" in v) == ("rate_Bps" in v):
        raise bad(fld, "give exactly one of rate (tc style: '100gbit', '25gbps', 'unlimited') "
                  "and rate_Bps (bytes per second, or null for unlimited)")
    if "rate" in v:
        try:
            if not isinstance(v["rate"], str):
                raise ValueError(f"expected a string such as '100gbit', got {v['rate']!r}")
            bps = parse_optional_rate(v["rate"])
        except (ValueError, TypeError) as e:
            raise bad(f"{fld}.rate", str(e)) from None
        theta = 0.0 if bps is None else 8.0 / bps
    else:
        r = v["rate_Bps"]
        if r is None:
            theta = 0.0
        elif isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0:
            theta = 1.0 / r
        else:
            raise bad(f"{fld}.rate_Bps", f"expected bytes per second > 0 (or null: unlimited), got {r!r}")
    return LinkCost(gamma=float(lat) * 1e-6, theta=theta)


def _ranges(ranks: Sequence[int]) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def _us(s: float) -> str:
    return f"{s * 1e6:.3g} us"


def _rate(theta: float) -> str:
    if theta == 0:
        return "unlimited"
    bps = 8.0 / theta
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


__all__ = ["ATTACH", "DEFAULT_INTER", "DEFAULT_INTRA", "INTER", "INTRA", "LINK_CLASSES", "PROBE_SIZES",
           "ExchangePrediction", "Topology", "fit_link_classes", "host_names", "predict_exchange",
           "probe_rounds", "used_classes"]
