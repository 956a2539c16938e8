"""A throw-away cluster on this machine for the multi-node tier: "nodes" with their own sshd, and Slurm.

Two ways to make nodes, chosen at start and printed in the test output:

* ``netns`` (needs root / ``CAP_NET_ADMIN``): each node is a Linux network namespace with a veth pair
  named ``eth0`` inside, joined by a bridge in a private test range (``10.213.N.0/24``, the bridge holds
  ``.254``), and its own PID namespace (so ``pkill`` on a node sees only that node's processes). Each
  node runs its own ``sshd`` on port 22 with its own generated host key.
* ``loopback`` (no ``CAP_NET_ADMIN``): one ``sshd`` on a free port listening on ``127.0.0.2``,
  ``127.0.0.3``, ... - one alias per node (same PID namespace, so node isolation is weaker). The ssh
  config names no port, so every back end must honour ``--ssh_port`` for the job to start.

Both: a generated user key, an ``authorized_keys`` and a pre-filled ``known_hosts`` in a temp dir, and
an ``ssh`` wrapper first on ``PATH`` that adds ``-F <our ssh_config>`` - ssh reads ``~/.ssh`` from the
password database, not ``$HOME``, so this is how pdsh, mpirun (Open MPI and MPICH) and dscore's ssh
runner use the throw-away keys without touching the real ``~/.ssh``. The filesystem is shared, so the
venv and the repository are visible on every node.

Slurm (:meth:`Cluster.start_slurm`): ``munged`` with its own key and socket, ``slurmctld`` and one
``slurmd -N <node>`` per node (in the node's network namespace; on loopback with distinct ports), all
configured in the temp dir, running as root (``SlurmUser=root``).

Everything started is stopped by :meth:`Cluster.close`, the namespaces and links are deleted, and
:meth:`Cluster.leftovers` reports any process or listening socket still there.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REQUIRED = ("sshd", "ssh", "ssh-keygen", "pdsh", "mpirun.openmpi", "mpiexec.hydra", "srun", "slurmctld", "slurmd",
            "munged", "pkill")  # fmt: skip
SBIN = ("/usr/sbin", "/sbin")


def which(name: str) -> str | None:
    """``shutil.which`` that also looks in the sbin directories (daemons live there)."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def missing_programs() -> list[str]:
    """Programs of :data:`REQUIRED` not installed here."""
    return [name for name in REQUIRED if which(name) is None]


def can_use_netns() -> bool:
    """True when network namespaces can be created (root with ``CAP_NET_ADMIN``, ``ip`` and ``nsenter``)."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("nsenter") or not shutil.which("unshare"):
        return False
    name = f"dscore-probe-{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True, check=False).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    return ok


def _die_with_parent() -> None:
    """``preexec_fn`` of every daemon: SIGKILL it when the test process dies (even when pytest is killed)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def remove_stale_namespaces() -> None:
    """Delete namespaces and links of earlier sessions whose test process is gone (killed pytest)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout.split()
    stale: set[str] = set()
    for name in names:
        if name.startswith("dscore-mn") and "-" in name[9:]:
            pid = name[9:].split("-")[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
                stale.add(pid)
    for pid in stale:
        subprocess.run(["ip", "link", "del", f"dsbr{pid}"], capture_output=True, check=False)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    """One node: ``name`` (Slurm NodeName), ``addr`` (what hostfiles use), network/PID namespace holder."""

    name: str
    addr: str
    netns: str | None = None
    holder_pid: int | None = None  # a process inside the node's namespaces (its sshd)

    def enter(self) -> list[str]:
        """argv prefix running a command on this node (its network, mount and PID namespaces)."""
        if self.holder_pid is None:
            return []
        return ["nsenter", "-t", str(self.holder_pid), "-n", "-m", "-p", "--"]


@dataclass
class Cluster:
    """See the module docstring. Build with :meth:`start`; always :meth:`close`."""

    root: Path
    mode: str
    nodes: list[Node] = field(default_factory=list)
    ssh_port: int = 22
    iface: str = "eth0"
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    slurm_conf: Path | None = None
    ports: list[int] = field(default_factory=list)
    _subnet: int = 0

    # ------------------------------------------------------------------ setup
    @classmethod
    def start(cls, root: Path, n_nodes: int = 3, force_loopback: bool = False) -> Cluster:
        mode = "netns" if not force_loopback and can_use_netns() else "loopback"
        cluster = cls(root=root, mode=mode)
        try:
            cluster._keys(n_nodes)
            if mode == "netns":
                cluster._start_netns(n_nodes)
            else:
                cluster._start_loopback(n_nodes)
            cluster._wait_ssh()
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _run(self, *argv: str) -> None:
        res = subprocess.run(argv, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")

    def _keys(self, n_nodes: int) -> None:
        ssh = self.root / "ssh"
        ssh.mkdir(mode=0o700)
        self._run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dscore-multinode-user", "-f", str(ssh / "user"))
        shutil.copy(ssh / "user.pub", ssh / "authorized_keys")
        for i in range(n_nodes):
            self._run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"host{i}", "-f", str(ssh / f"host{i}"))
        bin_dir = self.root / "bin"
        bin_dir.mkdir()
        wrapper = bin_dir / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {ssh / "config"} "$@"\n')
        wrapper.chmod(0o755)

    def _sshd_config(self, index: int, listen: list[str]) -> Path:
        ssh = self.root / "ssh"
        path = ssh / f"sshd{index}.conf"
        lines = [f"ListenAddress {a}" for a in listen] + [
            f"HostKey {ssh / f'host{index}'}",
            f"AuthorizedKeysFile {ssh / 'authorized_keys'}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",  # the keys live under /tmp (world-writable parent)
            "PidFile none",
            "MaxStartups 100:30:200",
            "MaxSessions 100",
            "LogLevel ERROR",
        ]
        path.write_text("\n".join(lines) + "\n")
        return path

    def _write_ssh_client(self, hosts_keys: list[tuple[str, int]]) -> None:
        ssh = self.root / "ssh"
        known = []
        for addr, index in hosts_keys:
            key = (ssh / f"host{index}.pub").read_text().split()[:2]
            name = addr if self.ssh_port == 22 else f"[{addr}]:{self.ssh_port}"
            known.append(f"{name} {' '.join(key)}")
        (ssh / "known_hosts").write_text("\n".join(known) + "\n")
        (ssh / "config").write_text(
            "Host *\n"
            f"  IdentityFile {ssh / 'user'}\n  IdentitiesOnly yes\n  User root\n"
            f"  UserKnownHostsFile {ssh / 'known_hosts'}\n  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n  BatchMode yes\n  LogLevel ERROR\n  ConnectTimeout 20\n"
        )  # no Port: on loopback every back end must pass --ssh_port itself

    def _start_netns(self, n_nodes: int) -> None:
        remove_stale_namespaces()
        tag = os.getpid() % 100000
        self._subnet = 20 + os.getpid() % 200
        bridge = f"dsbr{tag}"
        self._run("ip", "link", "add", bridge, "type", "bridge")
        self.links.append(bridge)
        self._run("ip", "addr", "add", f"{self.gateway}/24", "dev", bridge)
        self._run("ip", "link", "set", bridge, "up")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        for i in range(n_nodes):
            ns, veth = f"dscore-mn{tag}-{i}", f"dsv{tag}x{i}"
            self._run("ip", "netns", "add", ns)
            self.nodes.append(Node(name=f"dsn{i + 1}", addr=f"10.213.{self._subnet}.{i + 1}", netns=ns))
            self._run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.links.append(veth)
            self._run("ip", "link", "set", veth, "master", bridge, "up")
            self._run("ip", "-n", ns, "addr", "add", f"{self.nodes[-1].addr}/24", "dev", "eth0")
            self._run("ip", "-n", ns, "link", "set", "eth0", "up")
            self._run("ip", "-n", ns, "link", "set", "lo", "up")
        self._write_ssh_client([(n.addr, i) for i, n in enumerate(self.nodes)])
        for i, node in enumerate(self.nodes):
            conf = self._sshd_config(i, [f"{node.addr}:22"])
            log = open(self.root / f"sshd{i}.log", "wb")  # noqa: SIM115
            # unshare --fork: sshd is PID 1 of the node's PID namespace; when it dies, everything left
            # on that node is killed by the kernel
            proc = subprocess.Popen(
                ["ip", "netns", "exec", node.netns or "", "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
                 which("sshd") or "sshd", "-D", "-e", "-f", str(conf)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509
            )  # fmt: skip
            log.close()
            self.procs.append(proc)
            node.holder_pid = self._child_of(proc.pid, "sshd")

    def _child_of(self, pid: int, comm: str, timeout: float = 20.0) -> int:
        """The first descendant of ``pid`` whose command name is ``comm`` (sshd under unshare)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            todo = [pid]
            while todo:
                cur = todo.pop()
                try:
                    children = Path(f"/proc/{cur}/task/{cur}/children").read_text().split()
                except OSError:
                    children = []
                for child in map(int, children):
                    try:
                        if Path(f"/proc/{child}/comm").read_text().strip() == comm:
                            return child
                    except OSError:
                        pass
                    todo.append(child)
            time.sleep(0.05)
        raise RuntimeError(f"no {comm} process appeared under pid {pid}")

    def _start_loopback(self, n_nodes: int) -> None:
        self.iface = "lo"
        self.ssh_port = free_port()
        self.ports.append(self.ssh_port)
        self.nodes = [Node(name=f"dsn{i + 1}", addr=f"127.0.0.{i + 2}") for i in range(n_nodes)]
        # one host key for all aliases (one sshd)
        ssh = self.root / "ssh"
        for i in range(1, n_nodes):
            shutil.copy(ssh / "host0.pub", ssh / f"host{i}.pub")
        self._write_ssh_client([(n.addr, 0) for n in self.nodes])
        conf = self._sshd_config(0, [f"{n.addr}:{self.ssh_port}" for n in self.nodes])
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(exist_ok=True)
        log = open(self.root / "sshd0.log", "wb")  # noqa: SIM115
        self.procs.append(
            subprocess.Popen([which("sshd") or "sshd", "-D", "-e", "-f", str(conf)], stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=_die_with_parent)  # noqa: PLW1509
        )  # fmt: skip
        log.close()

    def _wait_ssh(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            while True:
                res = subprocess.run(self.ssh_argv(node.addr, "true"), capture_output=True, text=True,
                                     env=self.env(), timeout=60, check=False)  # fmt: skip
                if res.returncode == 0:
                    break
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    logs = "".join(p.read_text() for p in self.root.glob("sshd*.log"))
                    raise RuntimeError(f"sshd on {node.addr} unreachable: {res.stderr.strip()}\n{logs}")
                time.sleep(0.2)

    # ------------------------------------------------------------------ use
    @property
    def gateway(self) -> str:
        """Address of the launching host as the nodes see it (the bridge; loopback in loopback mode)."""
        return f"10.213.{self._subnet}.254" if self.mode == "netns" else "127.0.0.1"

    def describe(self) -> str:
        where = ", ".join(f"{n.name}={n.addr}" for n in self.nodes)
        if self.mode == "netns":
            return f"multi-node fixture: network namespaces ({where}), one sshd per node on port 22"
        return (f"multi-node fixture: LOOPBACK fallback (no CAP_NET_ADMIN): one sshd on port {self.ssh_port} "
                f"for aliases {where}")  # fmt: skip

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for launcher subprocesses: the ssh wrapper first on PATH, one thread per rank, Open MPI
        allowed to run as root (it refuses otherwise), no Open MPI tree spawn (orted would ssh between nodes
        without our wrapper), Slurm's config."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "PMIX_"))}
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "DS_ENV_FILE", "PDSH_SSH_ARGS_APPEND"):  # fmt: skip
            env.pop(k, None)
        env["PATH"] = os.pathsep.join([str(self.root / "bin"), os.path.dirname(sys.executable), env.get("PATH", ""),
                                       *SBIN])  # fmt: skip
        env.update(
            OMP_NUM_THREADS="1",
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
            OMPI_MCA_plm_rsh_no_tree_spawn="1",
            DS_ACCELERATOR="cpu",
        )
        if self.slurm_conf is not None:
            env["SLURM_CONF"] = str(self.slurm_conf)
        env.update(extra)
        return env

    def ssh_argv(self, host: str, command: str) -> list[str]:
        return [str(self.root / "bin" / "ssh"), "-p", str(self.ssh_port), host, command]

    def hostfile(self, path: Path, slots: list[int], names: bool = False) -> Path:
        """Write ``<addr or name> slots=k`` lines for the first ``len(slots)`` nodes."""
        lines = [f"{(n.name if names else n.addr)} slots={k}" for n, k in zip(self.nodes, slots, strict=False)]
        path.write_text("\n".join(lines) + "\n")
        return path

    # ------------------------------------------------------------------ slurm
    def start_slurm(self) -> None:
        """munged + slurmctld + one slurmd per node; raises RuntimeError with the logs when it cannot start."""
        d = self.root / "slurm"
        (d / "state").mkdir(parents=True)
        munge = self.root / "munge"
        munge.mkdir(mode=0o700)
        (munge / "key").write_bytes(os.urandom(1024))
        (munge / "key").chmod(0o600)
        sock = munge / "sock"
        self._spawn([which("munged") or "munged", "-F", "--force", f"--key-file={munge / 'key'}",
                     f"--socket={sock}", f"--pid-file={munge / 'pid'}", f"--log-file={munge / 'log'}",
                     f"--seed-file={munge / 'seed'}"], "munged")  # fmt: skip
        self._wait(lambda: sock.exists(), "munged socket", munge / "log")
        ctl_port, d_port = free_port(), free_port()
        self.ports += [ctl_port, d_port]
        cpus = 2
        node_lines = []
        for n in self.nodes:
            (d / f"spool-{n.name}").mkdir()
            port = ""
            if self.mode == "loopback":  # several slurmd on one address need their own ports
                self.ports.append(free_port())
                port = f" Port={self.ports[-1]}"
            node_lines.append(f"NodeName={n.name} NodeAddr={n.addr} NodeHostname={n.name} CPUs={cpus}{port} "
                              "State=UNKNOWN")  # fmt: skip
        ctl_host = socket.gethostname().split(".")[0]
        conf = d / "slurm.conf"
        conf.write_text("\n".join([
            "ClusterName=dscoretest",
            f"SlurmctldHost={ctl_host}({self.gateway})",
            f"SlurmctldPort={ctl_port}",
            f"SlurmdPort={d_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={sock}",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d}/spool-%n",
            f"SlurmctldPidFile={d / 'ctld.pid'}", f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d / 'ctld.log'}", f"SlurmdLogFile={d}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "SchedulerType=sched/builtin", "MpiDefault=none", "ReturnToService=2",
            "SlurmdParameters=config_overrides", "MailProg=/bin/true", "KillWait=3", "MinJobAge=2",
            "InactiveLimit=0", "SlurmctldTimeout=30", "SlurmdTimeout=30",
            *node_lines,
            f"PartitionName=test Nodes={','.join(n.name for n in self.nodes)} Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=FORCE:4",
        ]) + "\n")  # fmt: skip
        (d / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
        self.slurm_conf = conf
        env = self.env()
        self._spawn([which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(conf)], "slurmctld", env)
        for n in self.nodes:
            prefix = ["nsenter", f"--net=/run/netns/{n.netns}"] if n.netns else []
            self._spawn([*prefix, which("slurmd") or "slurmd", "-D", "-N", n.name, "-f", str(conf)], f"slurmd-{n.name}",
                        env)  # fmt: skip

        def all_idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True,
                                 check=False, timeout=30).stdout.split()  # fmt: skip
            return out.count("idle") == len(self.nodes)

        self._wait(all_idle, "every slurmd idle", d / "ctld.log", timeout=60)

    def _spawn(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> None:
        log = open(self.root / f"{name}.out", "wb")  # noqa: SIM115
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=env, start_new_session=True,
                                           preexec_fn=_die_with_parent))  # noqa: PLW1509  # fmt: skip
        log.close()

    def _wait(self, ok: object, what: str, log: Path, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():  # type: ignore[operator]
                return
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead:
                break
            time.sleep(0.2)
        outs = "".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.root.glob("*.out"))
        text = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        raise RuntimeError(f"timed out waiting for {what}\n{text}\n{outs}")

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop every process started (SIGTERM, then SIGKILL), delete namespaces and links."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        for proc in self.procs:  # anything left in their process groups (slurmstepd, sshd sessions)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for node in self.nodes:
            if node.netns:
                subprocess.run(["ip", "netns", "del", node.netns], capture_output=True, check=False)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)

    def leftovers(self) -> list[str]:
        """Processes or listening sockets of this cluster still present (empty after a clean :meth:`close`)."""
        found = []
        marker = str(self.root)
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z":
                    continue
            except OSError:
                continue
            if marker in cmd:
                found.append(f"pid {entry.name}: {cmd.strip()}")
        listening = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True, check=False).stdout
        addrs = [n.addr for n in self.nodes] + ([self.gateway] if self.mode == "netns" else [])
        for line in listening.splitlines():
            cols = line.split()
            local = cols[3] if len(cols) > 3 else ""
            if any(local.startswith(f"{a}:") for a in addrs) or any(local.endswith(f":{p}") for p in self.ports):
                found.append(f"listening: {local}")
        if self.mode == "netns":
            names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
            found += [f"netns {n.netns}" for n in self.nodes if n.netns and n.netns in names]
            links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=False).stdout
            found += [f"link {link}" for link in self.links if f"{link} " in links or f"{link}@" in links]
        return found
