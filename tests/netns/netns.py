"""Hosts in Linux network namespaces for the tests: one namespace per host,
each with a veth pair to a switch namespace whose bridge joins them (and
holds an address of its own, for a relay), so a test can shape a host's
link (tc tbf), cut it (ip link set ... down) and heal it. Everything is
made by the test and removed when it ends, failed or not (names carry the
process id; stale ones of a dead run are removed first)."""
import atexit
import os
import subprocess

PREFIX = "clv"
SUBNET = "10.77.0."


def sh(*cmd, check=True):
    p = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: rc {p.returncode}: {p.stderr.strip()}")
    return p


def available():
    """'' when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    name = f"{PREFIX}probe{os.getpid()}"
    p = sh("ip", "netns", "add", name, check=False)
    if p.returncode != 0:
        return "ip netns add failed: " + p.stderr.strip()
    sh("ip", "netns", "del", name, check=False)
    return ""


def remove_stale():
    """Namespaces of earlier runs whose process is gone."""
    p = sh("ip", "netns", "list", check=False)
    for line in p.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX) or "-" not in name:
            continue
        pid = name.split("-")[0][len(PREFIX):]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            sh("ip", "netns", "del", name, check=False)


class Network:
    """hosts: names; host i gets SUBNET.(i + 1), the switch SUBNET.254."""

    def __init__(self, hosts):
        remove_stale()
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.hosts = {}
        self.made = []
        self.root_links = []
        atexit.register(self.close)
        try:
            self._ns(self.switch)
            sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.switch, "addr", "add", SUBNET + "254/24", "dev", "br0")
            sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            sh("ip", "-n", self.switch, "link", "set", "lo", "up")
            for i, h in enumerate(hosts):
                ns = f"{self.tag}-{h}"
                self._ns(ns)
                addr = SUBNET + str(i + 1)
                # veth: "eth0" in the host, "v-<host>" on the switch's bridge.
                sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"v-{h}",
                   "netns", self.switch)
                sh("ip", "-n", ns, "addr", "add", addr + "/24", "dev", "eth0")
                sh("ip", "-n", ns, "link", "set", "eth0", "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "-n", self.switch, "link", "set", f"v-{h}", "master", "br0")
                sh("ip", "-n", self.switch, "link", "set", f"v-{h}", "up")
                self.hosts[h] = (ns, addr)
        except Exception:
            self.close()
            raise

    def _ns(self, name):
        sh("ip", "netns", "add", name)
        self.made.append(name)

    def attach_root(self, last_octet=200):
        """A veth from this (the root) namespace to the switch, so the test
        itself reaches the hosts; its address."""
        root, peer = f"{self.tag}r", f"v-{self.tag}r"[:15]
        sh("ip", "link", "add", root, "type", "veth", "peer", "name", peer, "netns", self.switch)
        self.root_links.append(root)
        addr = SUBNET + str(last_octet)
        sh("ip", "addr", "add", addr + "/24", "dev", root)
        sh("ip", "link", "set", root, "up")
        sh("ip", "-n", self.switch, "link", "set", peer, "master", "br0")
        sh("ip", "-n", self.switch, "link", "set", peer, "up")
        return addr

    def addr(self, host):
        return self.hosts[host][1]

    def run(self, host, cmd):
        """cmd prefixed to run in the host's namespace (the switch: 'switch')."""
        ns = self.switch if host == "switch" else self.hosts[host][0]
        return ["ip", "netns", "exec", ns, *cmd]

    def cut(self, host):
        sh("ip", "-n", self.switch, "link", "set", f"v-{host}", "down")

    def heal(self, host):
        sh("ip", "-n", self.switch, "link", "set", f"v-{host}", "up")

    def shape(self, host, rate="10gbit"):
        """tbf on both ends of the host's link: rate each way."""
        for ns, dev in ((self.hosts[host][0], "eth0"), (self.switch, f"v-{host}")):
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
               "burst", "4mb", "latency", "50ms")

    def close(self):
        for link in self.root_links:
            sh("ip", "link", "del", link, check=False)
        self.root_links = []
        for name in reversed(self.made):
            sh("ip", "netns", "del", name, check=False)
        self.made = []
