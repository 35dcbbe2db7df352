"""Bandwidth emulation: run commands behind rate-limited links inside network namespaces.

Two layouts, both built from scratch for one command and removed after it (docs/netem.md):
a **loopback** (``--hosts 1``), one namespace whose loopback all ranks share at RATE, and
**hosts** (``--hosts K``), K host namespaces on a bridge, each host's link limited to RATE
both ways, the command run once per host (:data:`PLACEHOLDERS`). ``--classes`` /
``--host-classes`` give the traffic of listed addresses (subnets) equal shares of the link
(``htb``) instead of one ``tbf`` shared per TCP flow; ``--delay`` adds a one-way delay
(``sch_netem``; refused where the kernel lacks it). Nothing is added to the root namespace,
and the namespaces are deleted when the command ends, fails, or this process receives
SIGINT, SIGTERM or SIGHUP.

The pure helpers (rate parsing, tbf sizing, command building, requirement checks) have
no side effects and are tested without root; :func:`main` and :class:`Emulation` act. The
file imports nothing of commsched: the bench runner runs it as a file of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

# --------------------------------------------------------------------------- constants
NETNS_PREFIX = "commsched"          # namespaces are named commsched-<pid>-<role>
SUBNET_PREFIX = "10.213.0."         # emulated host i has SUBNET_PREFIX + str(i + 1)
SUBNET_BITS = 24
MAX_HOSTS = 250
HOST_IFNAME = "cs0"                 # the host side of each emulated link
BRIDGE_IFNAME = "br0"
LOOPBACK_MTU = 65536                # Linux default for lo
VETH_MTU = 1500                     # Linux default for veth
LOOPBACK_MTUS = (65536, 9000, 1500)  # a shaped lo takes the largest whose packet fits the bucket
VETH_MTUS = (9000, 1500)            # likewise a shaped host link (jumbo frames when they fit)
BURST_TIME_S = 0.0005               # tbf bucket: 0.5 ms of traffic at the rate ...
BURST_SLACK_BYTES = 1024            # ... but at least one full packet plus headers
QUEUE_TIME_S = 0.02
CLASS_SUBNET = "127.0.0.0/8"         # --classes addresses: the namespace's own loopback only
HTB_DEFAULT_MINOR = 10               # class 1:10 carries traffic of no listed address
MAX_CLASSES = 8                      # --host-classes: subnets 10.213.1.0/24 .. 10.213.8.0/24
RDZV_PORT = 29400                   # free in a fresh namespace by construction
STOP_GRACE_S = 10.0                 # SIGTERM -> SIGKILL grace for the command
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
MAX_RATE_BPS = 10**12               # 1tbit: tbf's queue (QUEUE_TIME_S of traffic) must fit in 4 GiB

# placeholders filled in per host in --hosts mode (plain substring replacement)
PLACEHOLDERS = {
    "{host}": "index of this host, 0..K-1",
    "{hosts}": "K, the number of emulated hosts",
    "{addr}": "this host's address",
    "{addr0}": "host 0's address (a rendezvous point)",
    "{is_host0}": "1 on host 0, else 0",
    "{caddrC}": "this host's address in link class C = 1..N (--host-classes N)",
}

_RATE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$")
# tc(8) rate units, to bits per second; SI prefixes are powers of 1000, IEC of 1024
_RATE_UNITS: dict[str, float] = {  # bit, kbit, ..., tibit, then bps, kbps, ..., tibps
    f"{prefix}{unit}": per * scale for unit, per in (("bit", 1), ("bps", 8))
    for prefix, scale in (("", 1), ("k", 1e3), ("m", 1e6), ("g", 1e9), ("t", 1e12),
                          ("ki", 1024), ("mi", 1024**2), ("gi", 1024**3), ("ti", 1024**4))}
_UNSHAPED = ("none", "off", "unlimited")


class NetemError(RuntimeError):
    """Emulation could not be set up here (missing privilege, tool or kernel feature)."""


# --------------------------------------------------------------------------- pure helpers
def parse_rate(text: str) -> int:
    """A tc-style rate (``1gbit``, ``200mbit``, ``500kbit``, ``10mbps``) in bits per second.

    ``bit`` units count bits, ``bps`` units count bytes (as in tc); k/m/g/t are powers of
    1000, ki/mi/gi/ti powers of 1024. A bare number is refused as ambiguous.
    """
    if not isinstance(text, str):
        raise TypeError(f"rate must be a string such as '1gbit', got {type(text).__name__}")
    m = _RATE_RE.match(text.lower())
    if not m:
        raise ValueError(f"cannot read rate {text!r}; write it as tc does, e.g. 1gbit, 200mbit, 500kbit")
    num, unit = m.groups()
    if unit == "":
        raise ValueError(f"rate {text!r} has no unit; write e.g. {text.strip()}mbit (bits/s) "
                         f"or {text.strip()}mbps (bytes/s)")
    if unit not in _RATE_UNITS:
        raise ValueError(f"unknown rate unit {unit!r} in {text!r}; use one of "
                         + ", ".join(_RATE_UNITS))
    bps = float(num) * _RATE_UNITS[unit]
    if bps < 8000:
        raise ValueError(f"rate {text!r} is below 8kbit; tbf cannot shape that usefully")
    if bps > MAX_RATE_BPS:
        raise ValueError(f"rate {text!r} is above 1tbit, the most tc's token bucket takes (its queue of "
                         f"{QUEUE_TIME_S * 1000:g} ms of traffic must fit in 4 GiB); use --rate none for no limit")
    return int(round(bps))


def parse_optional_rate(text: str | None) -> int | None:
    """:func:`parse_rate`, with None / ``none`` / ``off`` / ``unlimited`` meaning unshaped."""
    if text is None or text.strip().lower() in _UNSHAPED:
        return None
    return parse_rate(text)


def format_rate(bps: int | None) -> str:
    """Bits per second as a short tc rate: 1000000000 -> '1gbit', 2.5e8 -> '250mbit'."""
    if bps is None:
        return "unshaped"
    units = (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3))  # whole units first, else 6 digits
    exact = next((f"{bps // scale}{unit}" for unit, scale in units if bps >= scale and bps % scale == 0), None)
    return exact or next((f"{bps / scale:.6g}{unit}" for unit, scale in units if bps >= scale), f"{bps}bit")


@dataclass(frozen=True)
class TbfParams:
    """One token bucket: ``rate_bps`` bits/s, a bucket of ``burst_bytes`` and a queue of
    ``limit_bytes`` (bucket plus waiting packets)."""

    rate_bps: int
    burst_bytes: int
    limit_bytes: int


def tbf_params(rate_bps: int, mtu: int) -> TbfParams:
    """Size a tbf for ``rate_bps`` on a device of this MTU: a bucket of :data:`BURST_TIME_S`
    of traffic or one whole packet, whichever is more, and a queue of :data:`QUEUE_TIME_S`
    more (the trade-off: docs/netem.md, "Sizing the token bucket"; a 10 KB bucket held
    1 Gbit/s to 82% here)."""
    if rate_bps <= 0:
        raise ValueError(f"rate must be > 0 bits/s, got {rate_bps}")
    if mtu < 68:
        raise ValueError(f"mtu must be >= 68 bytes, got {mtu}")
    rate_Bps = rate_bps / 8
    burst = max(mtu + BURST_SLACK_BYTES, int(rate_Bps * BURST_TIME_S))
    limit = burst + max(2 * (mtu + BURST_SLACK_BYTES), int(rate_Bps * QUEUE_TIME_S))
    return TbfParams(rate_bps, burst, limit)


def link_mtu(rate_bps: int | None, candidates: Sequence[int], default: int) -> int:
    """The largest MTU in ``candidates`` whose packet fits the :data:`BURST_TIME_S` bucket at
    this rate (the smallest candidate when none does); ``default`` when unshaped. Bigger
    packets cost less CPU and header overhead; smaller ones keep the bucket small."""
    if rate_bps is None:
        return default
    budget = rate_bps / 8 * BURST_TIME_S
    fitting = [m for m in candidates if m + BURST_SLACK_BYTES <= budget]
    return max(fitting) if fitting else min(candidates)


def loopback_mtu(rate_bps: int | None) -> int:
    """MTU for a shaped loopback (1500 / 9000 / 65536 by rate; 65536 unshaped)."""
    return link_mtu(rate_bps, LOOPBACK_MTUS, LOOPBACK_MTU)


def veth_mtu(rate_bps: int | None) -> int:
    """MTU for a shaped host link (1500 / 9000 by rate; 1500 unshaped)."""
    return link_mtu(rate_bps, VETH_MTUS, VETH_MTU)


def netns_cmd(ns: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside namespace ``ns``."""
    return ["ip", "netns", "exec", ns, *argv]


def shaping_commands(ns: str, dev: str, rate_bps: int | None, mtu: int,
                     delay_ms: float | None = None) -> list[list[str]]:
    """tc commands (run in ``ns``) limiting the egress of ``dev``; [] when unshaped and
    undelayed. With a delay, netem is the root and the tbf its child."""
    cmds: list[list[str]] = []
    tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
    tbf: list[str] = []
    if rate_bps is not None:
        p = tbf_params(rate_bps, mtu)
        tbf = ["tbf", "rate", f"{p.rate_bps}bit", "burst", str(p.burst_bytes),
               "limit", str(p.limit_bytes)]
    if delay_ms is not None and delay_ms > 0:
        cmds.append(tc + ["root", "handle", "1:", "netem", "delay", f"{delay_ms:g}ms",
                          "limit", "100000"])
        if tbf:
            cmds.append(tc + ["parent", "1:1", "handle", "10:", *tbf])
    elif tbf:
        cmds.append(tc + ["root", "handle", "1:", *tbf])
    return cmds


def parse_class_addresses(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """``--classes`` as a tuple of IPv4 loopback addresses (``127.0.0.2,127.0.0.3``); the
    namespace's own loopback only (127.0.0.0/8, not 127.0.0.1, which carries the rest)."""
    if text is None:
        return ()
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    out: list[str] = []
    for t in items:
        try:
            a = ipaddress.IPv4Address(t)
        except ValueError:
            raise ValueError(f"link class address {t!r} is not an IPv4 address; give loopback addresses "
                             f"such as 127.0.0.2") from None
        if a not in ipaddress.IPv4Network(CLASS_SUBNET) or str(a) == "127.0.0.1":
            raise ValueError(f"link class address {t} must be a loopback address of the namespace "
                             f"({CLASS_SUBNET}) other than 127.0.0.1, which carries all other traffic")
        if str(a) in out:
            raise ValueError(f"link class address {t} is given twice")
        out.append(str(a))
    return tuple(out)


def class_shaping_commands(ns: str, dev: str, rate_bps: int, mtu: int,
                           addresses: Sequence[str]) -> list[list[str]]:
    """tc commands (run in ``ns``) giving ``dev`` an ``htb`` of ``rate_bps`` with one class
    per address in ``addresses`` (packets from or to it; ``A.B.C.D/L``: that subnet) and a
    default class for the rest, each guaranteed an equal share and allowed to borrow all of
    it; each queues in a ``bfifo`` as deep as :func:`tbf_params`'s queue."""
    if not addresses:
        raise ValueError("class shaping needs at least one address")
    p = tbf_params(rate_bps, mtu)
    n = len(addresses) + 1
    share = max(1, rate_bps // n)
    base = ["ip", "netns", "exec", ns, "tc"]
    size = ["burst", str(p.burst_bytes), "cburst", str(p.burst_bytes), "quantum", str(mtu + BURST_SLACK_BYTES)]
    cmds = [base + ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", str(HTB_DEFAULT_MINOR)],
            base + ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
                    "rate", f"{rate_bps}bit", "ceil", f"{rate_bps}bit", *size]]
    minors = [HTB_DEFAULT_MINOR] + [HTB_DEFAULT_MINOR + 1 + i for i in range(len(addresses))]
    for m in minors:
        cmds.append(base + ["class", "add", "dev", dev, "parent", "1:1", "classid", f"1:{m}", "htb",
                            "rate", f"{share}bit", "ceil", f"{rate_bps}bit", *size])
        cmds.append(base + ["qdisc", "add", "dev", dev, "parent", f"1:{m}", "handle", f"{m}:",
                            "bfifo", "limit", str(p.limit_bytes)])
    for a, m in zip(addresses, minors[1:]):
        for direction in ("src", "dst"):
            cmds.append(base + ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                                "u32", "match", "ip", direction, a if "/" in a else f"{a}/32",
                                "flowid", f"1:{m}"])
    return cmds


@dataclass(frozen=True)
class NetSpec:
    """What to emulate: the fields are ``commsched netem``'s options (``--rate``, ``--hosts``,
    ``--delay``, ``--host-rate``, ``--classes``, ``--host-classes``; None: not limited);
    ``tag`` makes the names unique. The combinations the options refuse are refused here."""

    rate_bps: int | None
    hosts: int = 1
    delay_ms: float | None = None
    tag: str = ""
    host_rate_bps: int | None = None
    classes: tuple[str, ...] = ()
    host_classes: int = 0

    def __post_init__(self) -> None:
        h, hc, rate, cls, delay = self.hosts, self.host_classes, self.rate_bps, self.classes, self.delay_ms
        rules = [  # (refused?, why), checked in order: each only once the ones before it hold
            (lambda: not isinstance(h, int) or not 1 <= h <= MAX_HOSTS, f"hosts must be an integer in 1..{MAX_HOSTS}, "
                                                                         f"got {h!r}"),
            (lambda: delay is not None and not delay >= 0, f"delay must be >= 0 ms, got {delay}"),
            (lambda: rate is not None and rate <= 0, f"rate must be > 0 bits/s, got {rate}"),
            (lambda: self.host_rate_bps is not None and h < 2, "a host rate (--host-rate) needs --hosts K >= 2: with "
                                                               "one host the loopback is the link and --rate limits it"),
            (lambda: self.host_rate_bps is not None and self.host_rate_bps <= 0,
             f"host rate must be > 0 bits/s, got {self.host_rate_bps}"),
            (lambda: bool(cls) and parse_class_addresses(cls) != tuple(cls),
             f"classes must be distinct loopback addresses, got {cls!r}"),
            (lambda: bool(cls) and h != 1, "link classes (--classes) shape the shared loopback: they need --hosts 1"),
            (lambda: bool(cls) and rate is None, "link classes (--classes) share a limited link: give --rate"),
            (lambda: bool(cls) and bool(delay), "link classes (--classes) cannot be combined with --delay"),
            (lambda: isinstance(hc, bool) or not isinstance(hc, int) or not 0 <= hc <= MAX_CLASSES,
             f"host_classes must be an integer in 0..{MAX_CLASSES}, got {hc!r}"),
            (lambda: hc > 0 and h < 2, "--host-classes gives the emulated hosts' links classes: it needs --hosts K "
                                       ">= 2 (with one host, --classes ADDR classes the shared loopback)"),
            (lambda: hc > 0 and rate is None, "link classes (--host-classes) share a limited link: give --rate"),
            (lambda: hc > 0 and bool(delay), "link classes (--host-classes) cannot be combined with --delay"),
            (lambda: not re.fullmatch(r"[A-Za-z0-9_]*", self.tag), f"tag must be letters, digits or _, got {self.tag!r}")]
        for refused, why in rules:
            if refused():
                raise ValueError(why)


@dataclass(frozen=True)
class NetPlan:
    """The namespaces of one emulation and the commands that build them, in order."""

    host_ns: tuple[str, ...]          # where the command runs, one per host
    bridge_ns: str | None             # hosts mode only
    addresses: tuple[str, ...]        # per host: its address (127.0.0.1 in loopback mode)
    ifname: str                       # the interface the command's traffic leaves by
    setup: tuple[tuple[str, ...], ...] = field(default=())
    class_addresses: tuple[tuple[str, ...], ...] = ()  # per host: its address in class 1..N

    @property
    def namespaces(self) -> tuple[str, ...]:
        return self.host_ns + ((self.bridge_ns,) if self.bridge_ns else ())


def host_address(i: int) -> str:
    if not 0 <= i < MAX_HOSTS:
        raise ValueError(f"host index must be in 0..{MAX_HOSTS - 1}, got {i}")
    return f"{SUBNET_PREFIX}{i + 1}"


def class_address(i: int, c: int) -> str:
    """Host i's address in link class c (1..:data:`MAX_CLASSES`): ``10.213.c.(i+1)``, in the
    class's own /24 (host addresses are class 0's subnet, :data:`SUBNET_PREFIX`)."""
    if not 1 <= c <= MAX_CLASSES:
        raise ValueError(f"link class must be in 1..{MAX_CLASSES}, got {c}")
    return host_address(i).rsplit(".", 2)[0] + f".{c}.{i + 1}"


def _loopback_commands(ns: str, rate_bps: int | None) -> tuple[list[list[str]], int]:
    """Bring up the loopback of ``ns`` (its MTU lowered to fit the rate's bucket); its MTU."""
    mtu = loopback_mtu(rate_bps)
    lower = [netns_cmd(ns, ["ip", "link", "set", "dev", "lo", "mtu", str(mtu)])] if mtu != LOOPBACK_MTU else []
    return lower + [netns_cmd(ns, ["ip", "link", "set", "dev", "lo", "up"])], mtu


def plan_network(spec: NetSpec) -> NetPlan:
    """Names and set-up commands for ``spec`` (nothing is run here)."""
    base = f"{NETNS_PREFIX}-{spec.tag}" if spec.tag else NETNS_PREFIX
    cmds: list[list[str]] = []
    if spec.hosts == 1:
        ns = f"{base}-lo"
        lo, mtu = _loopback_commands(ns, spec.rate_bps)
        cmds += [["ip", "netns", "add", ns], *lo]
        if spec.classes:
            assert spec.rate_bps is not None  # NetSpec checked
            cmds += class_shaping_commands(ns, "lo", spec.rate_bps, mtu, spec.classes)
        else:
            cmds += shaping_commands(ns, "lo", spec.rate_bps, mtu, spec.delay_ms)
        return NetPlan((ns,), None, ("127.0.0.1",), "lo", tuple(map(tuple, cmds)))
    br = f"{base}-br"
    hosts = tuple(f"{base}-h{i}" for i in range(spec.hosts))
    addrs = tuple(host_address(i) for i in range(spec.hosts))
    cmds.append(["ip", "netns", "add", br])
    cmds += [["ip", "netns", "add", h] for h in hosts]
    cmds.append(netns_cmd(br, ["ip", "link", "add", BRIDGE_IFNAME, "type", "bridge"]))
    cmds.append(netns_cmd(br, ["ip", "link", "set", "dev", BRIDGE_IFNAME, "up"]))
    mtu = veth_mtu(spec.rate_bps)
    for i, (h, a) in enumerate(zip(hosts, addrs)):
        port = f"h{i}"  # bridge-side end of host i's link
        cmds.append(netns_cmd(br, ["ip", "link", "add", port, "mtu", str(mtu), "type", "veth",
                                   "peer", "name", HOST_IFNAME, "mtu", str(mtu), "netns", h]))
        cmds.append(netns_cmd(br, ["ip", "link", "set", "dev", port, "master", BRIDGE_IFNAME]))
        cmds.append(netns_cmd(br, ["ip", "link", "set", "dev", port, "up"]))
        lo, lo_mtu = _loopback_commands(h, spec.host_rate_bps)
        cmds += lo + shaping_commands(h, "lo", spec.host_rate_bps, lo_mtu)
        cmds.append(netns_cmd(h, ["ip", "addr", "add", f"{a}/{SUBNET_BITS}", "dev", HOST_IFNAME]))
        # the class addresses after the primary one, which stays the interface's first
        # (gloo binds to the first address of GLOO_SOCKET_IFNAME)
        for c in range(1, spec.host_classes + 1):
            cmds.append(netns_cmd(h, ["ip", "addr", "add", f"{class_address(i, c)}/{SUBNET_BITS}", "dev",
                                      HOST_IFNAME]))
        cmds.append(netns_cmd(h, ["ip", "link", "set", "dev", HOST_IFNAME, "up"]))
        if spec.host_classes:  # both directions of the link, one htb class per class subnet
            assert spec.rate_bps is not None  # NetSpec checked
            subnets = [class_address(0, c).rsplit(".", 1)[0] + f".0/{SUBNET_BITS}"
                       for c in range(1, spec.host_classes + 1)]
            cmds += class_shaping_commands(h, HOST_IFNAME, spec.rate_bps, mtu, subnets)
            cmds += class_shaping_commands(br, port, spec.rate_bps, mtu, subnets)
            continue
        # host -> bridge (upload) carries the one-way delay; bridge -> host (download) the rate only
        cmds += shaping_commands(h, HOST_IFNAME, spec.rate_bps, mtu, spec.delay_ms)
        cmds += shaping_commands(br, port, spec.rate_bps, mtu, None)
    caddrs = tuple(tuple(class_address(i, c) for c in range(1, spec.host_classes + 1)) for i in range(spec.hosts))
    return NetPlan(hosts, br, addrs, HOST_IFNAME, tuple(map(tuple, cmds)), caddrs if spec.host_classes else ())


def teardown_commands(plan: NetPlan) -> list[list[str]]:
    """Deleting the namespaces deletes their links, bridge, addresses and qdiscs."""
    return [["ip", "netns", "delete", ns] for ns in plan.namespaces]


def fill_placeholders(argv: Sequence[str], host: int, addresses: Sequence[str],
                      class_addresses: Sequence[Sequence[str]] = ()) -> list[str]:
    """``argv`` for host ``host`` with each :data:`PLACEHOLDERS` key replaced
    (``class_addresses[host][c - 1]``: ``{caddrC}``)."""
    values = {"{host}": str(host), "{hosts}": str(len(addresses)), "{addr}": addresses[host],
              "{addr0}": addresses[0], "{is_host0}": "1" if host == 0 else "0"}
    if class_addresses:
        values.update({f"{{caddr{c + 1}}}": a for c, a in enumerate(class_addresses[host])})
    return [functools.reduce(lambda a, kv: a.replace(*kv), values.items(), arg) for arg in argv]


def child_env(plan: NetPlan, base: dict[str, str]) -> dict[str, str]:
    """The environment of the emulated command: gloo / tensorpipe bound to the emulated
    interface (the machine's hostname resolves to an address that does not exist inside)."""
    return {**base, "GLOO_SOCKET_IFNAME": plan.ifname, "TP_SOCKET_IFNAME": plan.ifname}


def check_requirements(euid: int, which: Callable[[str], str | None] = shutil.which) -> str | None:
    """Why emulation cannot run here, or None when it can (root and ``ip``/``tc`` found)."""
    problems = []
    if euid != 0:
        problems.append(f"it needs root to create network namespaces and qdiscs (effective uid is {euid}); "
                        "run it as root (e.g. with sudo)")
    missing = [t for t in ("ip", "tc") if which(t) is None]
    if missing:
        problems.append(f"the {' and '.join(repr(t) for t in missing)} command{'s are' if len(missing) > 1 else ' is'} "
                        "missing; install iproute2 (e.g. apt-get install iproute2)")
    return "bandwidth emulation is unavailable: " + "; ".join(problems) if problems else None


def exit_code(returncodes: Sequence[int | None]) -> int:
    """One exit status for several commands: the first failure (signals as 128+N), else 0."""
    return next((128 - rc if rc < 0 else rc for rc in returncodes if rc not in (None, 0)), 0)


# --------------------------------------------------------------------------- acting
def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and p.returncode != 0:
        msg = (p.stderr or p.stdout).strip().splitlines()
        raise NetemError(f"`{' '.join(cmd)}` failed: {msg[-1] if msg else f'exit {p.returncode}'}")
    return p


_MISSING_QDISC = {  # a qdisc tc calls unknown -> what the user is told
    "netem": "--delay is not supported on this machine: the kernel has no netem qdisc (sch_netem), "
             "which adding a delay needs. Run without --delay.",
    "htb": "the kernel has no htb qdisc (sch_htb), which link classes (--classes) need; run without --classes",
    "tbf": "the kernel has no tbf qdisc (sch_tbf), which rate limiting needs",
}


def _explain_setup_failure(err: NetemError, spec: NetSpec) -> NetemError:
    text = str(err)
    qdisc = next((q for q in _MISSING_QDISC if q in text and "unknown" in text.lower()), None)
    return err if qdisc is None else NetemError(f"{_MISSING_QDISC[qdisc]} ({text})")


def list_namespaces() -> list[str]:
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


class Emulation:
    """Context manager: builds ``plan_network(spec)`` on enter, deletes every namespace it
    created on exit (also after a failed set-up)."""

    def __init__(self, spec: NetSpec):
        self.spec = spec
        self.plan = plan_network(spec)
        self.created: list[str] = []

    def __enter__(self) -> "Emulation":
        try:
            for cmd in self.plan.setup:
                adds = cmd[:3] == ("ip", "netns", "add")
                if adds and cmd[3] in list_namespaces():
                    raise NetemError(f"network namespace {cmd[3]} already exists; "
                                     f"remove it with `ip netns delete {cmd[3]}`")
                _run(cmd)
                if adds:
                    self.created.append(cmd[3])
        except BaseException as e:
            self.close()
            if isinstance(e, NetemError):
                raise _explain_setup_failure(e, self.spec) from None
            raise
        return self

    def close(self) -> list[str]:
        """Delete the namespaces created; return the ones that could not be deleted."""
        left = [ns for ns in reversed(self.created) if _run(["ip", "netns", "delete", ns], check=False).returncode]
        self.created = []
        return left

    def __exit__(self, *exc) -> None:
        left = self.close()
        if left:
            print(f"commsched netem: could not delete namespaces {left}; remove them with "
                  f"`ip netns delete NAME`", file=sys.stderr)


class _Stop(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def _stop_all(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:  # the group may hold children that outlive the leader
        _signal_group(p, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn``: the kernel sends the child ``sig`` once this process dies, by SIGKILL too
    (``prctl(PR_SET_PDEATHSIG)``, kept across ``ip netns exec``), so the command never runs on in
    an orphaned namespace; SIGTERM lets torchrun stop its workers. None without prctl (not Linux)."""
    try:
        prctl, parent = __import__("ctypes").CDLL(None, use_errno=True).prctl, os.getpid()
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl: no signal would come
            os.kill(os.getpid(), sig)
    return preexec


def run_emulated(spec: NetSpec, argv: Sequence[str], env: dict[str, str] | None = None,
                 grace_s: float = STOP_GRACE_S) -> int:
    """Run ``argv`` inside the emulation (once per host in hosts mode); return its status.
    SIGINT/SIGTERM/SIGHUP stop it (SIGKILL after ``grace_s``), 128+signal once the namespaces
    are deleted; a failing host stops the others (docs/netem.md, "Clean-up guarantees")."""
    if not argv:
        raise ValueError("no command given; put it after --, e.g. commsched netem --rate 1gbit -- python x.py")
    state, old = {"armed": True}, {}  # old: the signal handlers replaced, restored at the end

    def on_signal(signum, frame):
        if state["armed"]:  # later signals must not interrupt the clean-up
            state["armed"] = False
            raise _Stop(signum)

    try:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                old[s] = signal.signal(s, on_signal)
        with Emulation(spec) as em:
            procs: list[subprocess.Popen] = []
            try:
                e = child_env(em.plan, dict(os.environ if env is None else env))
                for i, ns in enumerate(em.plan.host_ns):
                    cmd = netns_cmd(ns, fill_placeholders(argv, i, em.plan.addresses, em.plan.class_addresses))
                    procs.append(subprocess.Popen(cmd, env=e, start_new_session=True, preexec_fn=die_with_parent()))
                while True:
                    rcs = [p.poll() for p in procs]
                    if all(rc is not None for rc in rcs):
                        return exit_code(rcs)
                    if any(rc not in (None, 0) for rc in rcs):
                        state["armed"] = False
                        _stop_all(procs, grace_s)
                        return exit_code(rcs)
                    time.sleep(0.05)
            except BaseException:
                state["armed"] = False
                _stop_all(procs, grace_s)
                raise
            finally:
                state["armed"] = False
    except _Stop as st:
        return 128 + st.signum
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# the names commsched netem gives: commsched-<pid>-lo | -br | -h<i> (tag = the pid of the
# `commsched netem` process, no leading zero) and the delay probe's commsched-probe<pid>-lo
_OWNED_NAME = re.compile(rf"({NETNS_PREFIX}-(?:([1-9][0-9]*)|probe([1-9][0-9]*)))-(lo|br|h[0-9]+)")


def namespace_owner(name: str) -> tuple[str, int] | None:
    """``(base, pid)`` of a namespace named by commsched netem (``commsched-<pid>-lo``,
    ``-br``, ``-h<i>``, or the probe's ``commsched-probe<pid>-lo``): ``base`` is the name
    every namespace of that one emulation starts with. None for any other name."""
    m = _OWNED_NAME.fullmatch(name)
    if m is None or (m.group(3) is not None and m.group(4) != "lo"):
        return None
    return m.group(1), int(m.group(2) or m.group(3))


def cleanup_plan(names: Sequence[str], alive: Callable[[int], bool],
                 pids: Callable[[str], Sequence[int] | None]) -> tuple[list[str], list[tuple[str, str]]]:
    """``--cleanup``'s choice: our namespaces (:func:`namespace_owner`) left by an emulation that is over (its
    process not ``alive``, none of its namespaces holding a process: judged together; docs/netem.md, "Clean-up
    guarantees"), and each of ours kept with why. ``pids(ns)``: the processes in ``ns``, None: unknown. Pure."""
    groups: dict[tuple[str, int], list[str]] = {}
    for n in names:
        if namespace_owner(n) is not None:
            groups.setdefault(namespace_owner(n), []).append(n)
    why: dict[str, str] = {}
    for (_, pid), members in groups.items():
        inside = {} if alive(pid) else {m: pids(m) for m in members}
        busy = [m for m, ps in inside.items() if ps is None or ps]
        for m, ps in ((m, inside.get(m, ())) for m in members):
            why[m] = (f"its emulator (pid {pid}) still runs" if alive(pid) else "cannot tell whether a process "
                      "runs in it (`ip netns pids` failed)" if ps is None else f"in use by pid "
                      f"{', '.join(map(str, ps))}" if ps else f"{busy[0]} of the same emulation is in use" if busy else "")
    return [n for n in names if why.get(n) == ""], [(n, why[n]) for n in names if why.get(n)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _namespace_pids(ns: str) -> list[int] | None:
    """The processes in namespace ``ns`` (``ip netns pids``); None when that cannot be told."""
    p = _run(["ip", "netns", "pids", ns], check=False)
    out = p.stdout.split()
    return None if p.returncode or not all(t.isdigit() for t in out) else [int(t) for t in out]


def _rate_arg(text: str) -> str:
    try:  # --rate / --host-rate checked as the parser reads them, tc's range included
        parse_optional_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    ph = "; ".join(f"{k}: {v}" for k, v in PLACEHOLDERS.items())
    p = argparse.ArgumentParser(
        prog="commsched netem",
        description="Run COMMAND behind an emulated, rate-limited network (needs root, ip and tc).",
        epilog=f"In --hosts mode COMMAND runs once per host with placeholders filled in: {ph}.",
        allow_abbrev=False)
    p.add_argument("--rate", type=_rate_arg, help="link rate in tc syntax: 1gbit, 200mbit, 500kbit; 'none' for unlimited links")
    p.add_argument("--delay", type=float, default=None, metavar="MS",
                   help="one-way delay in milliseconds (needs the netem qdisc; refused when missing)")
    p.add_argument("--hosts", type=int, default=1, metavar="K",
                   help="1 (default): one namespace with a shaped loopback; K >= 2: K hosts on a bridge")
    p.add_argument("--host-rate", default=None, metavar="RATE", type=_rate_arg,
                   help="with --hosts K: limit of traffic between the processes of one host (its "
                        "loopback, shared by them), tc syntax; default unlimited")
    p.add_argument("--classes", default=None, metavar="ADDR[,ADDR...]",
                   help="loopback layout: give the traffic from or to each of these loopback addresses "
                        "(127.0.0.2, ...) its own equal share of the link (htb), all other traffic one more "
                        "share, instead of one tbf shared per TCP flow")
    p.add_argument("--host-classes", type=int, default=0, metavar="N",
                   help="with --hosts K: N link classes on every host link, class C a subnet of its own "
                        "(host i's address in it: 10.213.C.(i+1), {caddrC} in COMMAND); each class and the "
                        "rest get an equal share of the link (htb), in both directions")
    p.add_argument("--cleanup", action="store_true",
                   help="delete namespaces left behind by commsched netem processes that no longer exist "
                        "(and in which no process still runs), then exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    cmd = list(a.command)[1 if a.command[:1] == ["--"] else 0:]
    problem = check_requirements(os.geteuid())
    if problem:
        print(f"commsched netem: {problem}", file=sys.stderr)
        return 2
    if a.cleanup:
        gone, kept = cleanup_plan(list_namespaces(), _pid_alive, _namespace_pids)
        for ns in gone:
            _run(["ip", "netns", "delete", ns], check=False)
        print(f"commsched netem: deleted {len(gone)} stale namespace(s)" + (f": {', '.join(gone)}" if gone else ""))
        for ns, why in kept:
            print(f"commsched netem: kept {ns}: {why}")
        return 0
    if a.rate is None:
        p.error("--rate is required (e.g. --rate 1gbit, or --rate none for unlimited links)")
    if not cmd:
        p.error("no command given; put it after --, e.g. commsched netem --rate 1gbit -- python x.py")
    try:
        spec = NetSpec(parse_optional_rate(a.rate), a.hosts, a.delay, tag=str(os.getpid()),
                       host_rate_bps=parse_optional_rate(a.host_rate),
                       classes=parse_class_addresses(a.classes), host_classes=a.host_classes)
        return run_emulated(spec, cmd)
    except (ValueError, NetemError) as e:
        print(f"commsched netem: {e}", file=sys.stderr)
        return 2


__all__ = ["NetSpec", "NetPlan", "NetemError", "TbfParams", "Emulation", "parse_rate",
           "parse_optional_rate", "format_rate", "tbf_params", "parse_class_addresses",
           "class_shaping_commands", "class_address", "plan_network", "teardown_commands",
           "fill_placeholders", "check_requirements", "run_emulated", "namespace_owner",
           "cleanup_plan", "die_with_parent", "main"]

if __name__ == "__main__":
    sys.exit(main())
