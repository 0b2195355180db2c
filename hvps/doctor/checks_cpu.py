"""CPU, memory and kernel-scheduler checks (the seed's chapter 2, without its unsafe values)."""
from __future__ import annotations

from typing import Optional

from .base import Check, Context, check, gib
from .host import Host

THP = "/sys/kernel/mm/transparent_hugepage"
#: drivers whose "powersave" governor still scales up under load (elsewhere it pins the lowest clock)
DYNAMIC_POWERSAVE = ("intel_pstate", "amd-pstate", "amd-pstate-epp", "intel_cpufreq")
SHM_FAIL = 256 << 20          # Docker's default is 64 MiB
SHM_PER_RANK = 1 << 30        # DataLoader workers + MPI shared-memory segments, per local rank
MEM_FAIL_PER_RANK = 2 << 30   # a torch rank: interpreter, model, optimizer state, a batch
MEM_WARN_PER_RANK = 4 << 30
NOFILE_OK, NOFILE_FAIL = 65536, 1024
GRANULARITY_FAIL_NS, GRANULARITY_WARN_NS = 100_000, 500_000
GRANULARITY_FILES = ("/proc/sys/kernel/sched_min_granularity_ns", "/sys/kernel/debug/sched/min_granularity_ns",
                     "/sys/kernel/debug/sched/base_slice_ns")


def parse_cpulist(text: Optional[str]) -> set:
    """``0-3,8,10-11`` -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set = set()
    for part in (text or "").replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def status_field(host: Host, name: str) -> Optional[str]:
    """A field of /proc/self/status."""
    for line in (host.read("/proc/self/status") or "").splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    return None


def omp_threads(host: Host) -> int:
    """Threads per rank: the first number of OMP_NUM_THREADS (``4`` or nested ``4,2``), else 1."""
    first = (host.env.get("OMP_NUM_THREADS") or "1").split(",")[0].strip()
    return max(1, int(first)) if first.isdigit() else 1


@check("cpu.governor", "cpu", mismatch="warn")
def governor(host: Host, ctx: Context) -> Check:
    why = ("a slow or scaling governor makes each rank's compute time vary; a ring all-reduce runs at the pace "
           "of the slowest rank")
    files = host.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_governor")
    govs = {g for g in (host.read(f) for f in files) if g}
    if not govs:
        return Check("cpu.governor", "skip", "no cpufreq", why + "; here the kernel exposes no frequency scaling "
                     "(a VM or container: the hypervisor or host decides)")
    driver = host.read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_driver") or "?"
    value = f"{'/'.join(sorted(govs))} (driver {driver}, {len(files)} CPUs)"
    fix = "hvps doctor --apply governor (or: cpupower frequency-set -g performance)"
    if govs == {"performance"}:
        return Check("cpu.governor", "ok", value, why, data={"governors": sorted(govs), "driver": driver})
    if "powersave" in govs and driver not in DYNAMIC_POWERSAVE:
        return Check("cpu.governor", "fail", value, why + f"; with {driver}, powersave pins the lowest clock",
                     fix, {"governors": sorted(govs), "driver": driver})
    return Check("cpu.governor", "warn", value, why, fix, {"governors": sorted(govs), "driver": driver})


@check("cpu.smt", "cpu", mismatch="warn")
def smt(host: Host, ctx: Context) -> Check:
    why = "with SMT two hardware threads share one core: size OMP_NUM_THREADS per rank in physical cores"
    control = host.read("/sys/devices/system/cpu/smt/control")
    active = host.read("/sys/devices/system/cpu/smt/active")
    if control is None:
        return Check("cpu.smt", "skip", "unknown", why + " (no /sys/devices/system/cpu/smt here)")
    threads = omp_threads(host)
    value = f"{control} (active {active})"
    if active == "1" and threads * ctx.ranks_per_node > max(1, len(
            host.glob("/sys/devices/system/cpu/cpu[0-9]*")) // 2):
        return Check("cpu.smt", "warn", value + f", OMP_NUM_THREADS={threads} x {ctx.ranks_per_node} ranks",
                     why + "; this job's threads outnumber the physical cores, so they contend for execution units",
                     "lower OMP_NUM_THREADS to physical cores / ranks per node (hvpsrun's default does that)")
    return Check("cpu.smt", "ok", value, why)


def numa_nodes(host: Host) -> dict:
    return {int(p.rsplit("node", 1)[1]): parse_cpulist(host.read(p + "/cpulist"))
            for p in host.glob("/sys/devices/system/node/node[0-9]*")}


@check("cpu.numa", "cpu")
def numa(host: Host, ctx: Context) -> Check:
    why = ("a rank whose threads and memory sit on different NUMA nodes pays remote-memory latency on every "
           "gradient copy")
    nodes = numa_nodes(host)
    allowed = parse_cpulist(status_field(host, "Cpus_allowed_list"))
    if not nodes:
        return Check("cpu.numa", "skip", "unknown", why + " (no /sys/devices/system/node here)")
    touched = sorted(n for n, cpus in nodes.items() if cpus & allowed) if allowed else sorted(nodes)
    value = f"{len(nodes)} node(s); this rank may run on node(s) {','.join(map(str, touched))}"
    if len(nodes) == 1 or len(touched) <= 1:
        return Check("cpu.numa", "ok", value, why, data={"nodes": len(nodes), "bound_to": touched})
    return Check("cpu.numa", "warn", value, why + "; this rank is not bound within one node",
                 "bind each rank to one NUMA node: hvpsrun --mpi-args='--map-by numa --bind-to numa' replaces "
                 "its default --bind-to none (Open MPI), or start ranks under numactl --cpunodebind=N --membind=N",
                 {"nodes": len(nodes), "bound_to": touched})


@check("mem.thp", "memory", mismatch="warn")
def thp(host: Host, ctx: Context) -> Check:
    why = ("transparent huge pages: 'madvise' lets torch's allocator ask for them for large tensors; "
           "'always' with defrag 'always' stalls page faults in direct compaction")
    enabled, defrag = host.read_choice(THP + "/enabled"), host.read_choice(THP + "/defrag")
    if enabled is None:
        return Check("mem.thp", "skip", "unknown", why + " (no THP settings in /sys here)")
    value = f"enabled={enabled} defrag={defrag}"
    fix = "hvps doctor --apply thp (writes madvise to enabled and defrag; --revert restores them)"
    if enabled == "always" and defrag == "always":
        return Check("mem.thp", "fail", value, why, fix)
    if enabled == "madvise" and defrag in ("madvise", "defer", "defer+madvise", "never", None):
        return Check("mem.thp", "ok", value, why)
    return Check("mem.thp", "warn", value, why + ("; 'never' denies huge pages even where asked for"
                                                  if enabled == "never" else ""), fix)


@check("mem.swappiness", "memory")
def swappiness(host: Host, ctx: Context) -> Check:
    why = "a swapped-out gradient or optimizer buffer stalls its rank, and with it every other rank"
    value = host.read_int("/proc/sys/vm/swappiness")
    swap = _meminfo(host).get("SwapTotal")
    if value is None:
        return Check("mem.swappiness", "skip", "unknown", why + " (no /proc/sys/vm/swappiness here)")
    shown = f"{value} (swap {gib(swap) if swap is not None else 'unknown'})"
    fix = "sysctl -w vm.swappiness=10 (persist in /etc/sysctl.d/), or run without swap"
    if swap == 0 or value <= 10:
        return Check("mem.swappiness", "ok", shown, why)
    if value > 60:
        return Check("mem.swappiness", "fail", shown, why + "; above 60 the kernel prefers swapping process "
                     "memory to dropping file cache", fix)
    return Check("mem.swappiness", "warn", shown, why, fix)


def _meminfo(host: Host) -> dict:
    out = {}
    for line in (host.read("/proc/meminfo") or "").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


@check("ulimit.memlock", "memory")
def memlock(host: Host, ctx: Context) -> Check:
    why = ("RDMA (InfiniBand/RoCE) transports pin every buffer they register; with a small memlock limit "
           "MPI and NCCL fall back to TCP or fail to register memory")
    lim = host.rlimit("memlock")
    if lim is None:
        return Check("ulimit.memlock", "skip", "unknown", why)
    soft = lim[0]
    value = "unlimited" if soft is None else gib(soft)
    fix = ("restart the container with --ulimit memlock=-1 (Kubernetes: the runtime's default ulimits)"
           if ctx.container else "'* - memlock unlimited' in /etc/security/limits.conf (or LimitMEMLOCK=infinity "
           "for a systemd unit), then log in again")
    if soft is None:
        return Check("ulimit.memlock", "ok", value, why)
    if host.glob("/sys/class/infiniband/*"):
        return Check("ulimit.memlock", "fail", value, why + "; this node has RDMA devices", fix)
    return Check("ulimit.memlock", "warn", value, why + "; no RDMA device here, so only pinned host "
                 "buffers are affected", fix)


@check("ulimit.nofile", "memory")
def nofile(host: Host, ctx: Context) -> Check:
    why = ("every rank holds sockets to its peers (control plane, MPI TCP, NCCL) plus DataLoader pipes and "
           "checkpoint files; running out shows up as EMFILE in the middle of training")
    lim = host.rlimit("nofile")
    if lim is None:
        return Check("ulimit.nofile", "skip", "unknown", why)
    soft, hard = lim
    value = f"soft {'unlimited' if soft is None else soft}, hard {'unlimited' if hard is None else hard}"
    fix = ("ulimit -n $(ulimit -Hn) in the job script; raise the hard limit with '* - nofile 1048576' in "
           "/etc/security/limits.conf" + (" or docker run --ulimit nofile=1048576" if ctx.container else ""))
    if soft is None or soft >= NOFILE_OK:
        return Check("ulimit.nofile", "ok", value, why)
    if soft < NOFILE_FAIL:
        return Check("ulimit.nofile", "fail", value, why, fix)
    return Check("ulimit.nofile", "warn", value, why, fix)


@check("mem.shm", "memory")
def shm(host: Host, ctx: Context) -> Check:
    why = (f"MPI's shared-memory transport and torch's DataLoader workers pass data through /dev/shm; below "
           f"{gib(SHM_FAIL)} workers die with 'Bus error' and MPI falls back or aborts "
           f"(want {gib(SHM_PER_RANK)} per rank on the node)")
    st = host.statvfs("/dev/shm")
    if st is None:
        return Check("mem.shm", "fail", "no /dev/shm", why, "mount a tmpfs on /dev/shm")
    need = SHM_PER_RANK * ctx.ranks_per_node
    value = f"{gib(st['total'])} ({gib(st['free'])} free; {ctx.ranks_per_node} rank(s) on this node)"
    if ctx.container:
        fix = (f"docker run --ipc=host (or --shm-size={max(1, need >> 30)}g); Kubernetes: an emptyDir with "
               "medium: Memory mounted at /dev/shm")
    else:
        fix = f"mount -o remount,size={max(1, need >> 30)}G /dev/shm (and in /etc/fstab)"
    data = {"total": st["total"], "free": st["free"]}
    if st["total"] < SHM_FAIL:
        return Check("mem.shm", "fail", value, why, fix, data)
    if st["total"] < need or st["free"] < need // 2:
        return Check("mem.shm", "warn", value, why, fix, data)
    return Check("mem.shm", "ok", value, why, data=data)


def cgroup_dirs(host: Host, controller: str) -> list:
    """Directories whose ``controller`` limits apply to this process: its cgroup and every
    ancestor (v2 and v1), and the mount root (inside a container that is the container's cgroup)."""
    dirs = []
    for line in (host.read("/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, names, path = parts
        if names and controller not in names.split(","):
            continue
        mounts = ["/sys/fs/cgroup"] if names == "" else [f"/sys/fs/cgroup/{names}", f"/sys/fs/cgroup/{controller}"]
        steps = [s for s in path.split("/") if s]
        for mount in mounts:
            dirs += ["/".join([mount, *steps[:i]]) for i in range(len(steps), -1, -1)]
    return list(dict.fromkeys(dirs + ["/sys/fs/cgroup"]))


def _tightest(values: list) -> Optional[float]:
    found = [v for v in values if v is not None]
    return min(found) if found else None


def _cpu_limit(host: Host, d: str) -> Optional[float]:
    text = host.read(d + "/cpu.max")
    if text:
        quota, _, period = text.partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    quota = host.read_int(d + "/cpu.cfs_quota_us")
    if quota is None or quota < 0:
        return None
    return quota / (host.read_int(d + "/cpu.cfs_period_us") or 100000)


def _memory_limit(host: Host, d: str) -> Optional[int]:
    text = host.read(d + "/memory.max")
    if text:
        return None if text == "max" else int(text)
    limit = host.read_int(d + "/memory.limit_in_bytes")
    return None if limit is None or limit >= 1 << 60 else limit


def cgroup_cpus(host: Host) -> Optional[float]:
    """CPUs the tightest cgroup quota allows (None: no limit found)."""
    return _tightest([_cpu_limit(host, d) for d in cgroup_dirs(host, "cpu")])


def cgroup_memory(host: Host) -> Optional[int]:
    """The tightest cgroup memory limit in bytes (None: no limit found)."""
    return _tightest([_memory_limit(host, d) for d in cgroup_dirs(host, "memory")])


@check("cgroup.cpu", "cpu")
def cgroup_cpu(host: Host, ctx: Context) -> Check:
    why = ("a CPU quota below the ranks' demand throttles them for whole scheduler periods (100 ms), and a "
           "throttled rank stalls every collective")
    cpus = cgroup_cpus(host)
    threads = omp_threads(host)
    demand = ctx.ranks_per_node * threads
    fix = (f"give the container at least {demand} CPUs (docker run --cpus={demand}; Kubernetes resources.limits.cpu), "
           "or run fewer ranks / threads per node" if ctx.container else
           f"raise the cgroup's cpu.max to at least {demand} CPUs, or run fewer ranks / threads per node")
    if cpus is None:
        return Check("cgroup.cpu", "ok", "no CPU quota", why)
    value = f"{cpus:g} CPUs for {ctx.ranks_per_node} rank(s) x {threads} thread(s)"
    if cpus < ctx.ranks_per_node:
        return Check("cgroup.cpu", "fail", value, why, fix, {"cpus": cpus})
    if cpus < demand:
        return Check("cgroup.cpu", "warn", value, why, fix, {"cpus": cpus})
    return Check("cgroup.cpu", "ok", value, why, data={"cpus": cpus})


@check("cgroup.memory", "memory")
def cgroup_mem(host: Host, ctx: Context) -> Check:
    why = (f"the OOM killer ends a rank without a trace when the cgroup limit is reached (tmpfs /dev/shm counts "
           f"against it); rough floor per torch rank: {gib(MEM_FAIL_PER_RANK)}, comfortable "
           f"{gib(MEM_WARN_PER_RANK)}")
    limit = cgroup_memory(host)
    if limit is None:
        return Check("cgroup.memory", "ok", "no memory limit", why)
    per_rank = limit / ctx.ranks_per_node
    value = f"{gib(limit)} for {ctx.ranks_per_node} rank(s) ({gib(per_rank)} each)"
    fix = ("raise the container's memory limit (docker run --memory; Kubernetes resources.limits.memory) "
           "or run fewer ranks per node" if ctx.container else
           "raise the cgroup's memory.max (systemd: MemoryMax=) or run fewer ranks per node")
    if per_rank < MEM_FAIL_PER_RANK:
        return Check("cgroup.memory", "fail", value, why, fix, {"limit": limit})
    if per_rank < MEM_WARN_PER_RANK:
        return Check("cgroup.memory", "warn", value, why, fix, {"limit": limit})
    return Check("cgroup.memory", "ok", value, why, data={"limit": limit})


@check("sched.policy", "cpu")
def sched_policy(host: Host, ctx: Context) -> Check:
    why = ("real-time priority for training processes (the seed's 'chrt -f 99') starves kernel threads, "
           "network interrupts and MPI progress; a busy-polling rank at SCHED_FIFO can lock up the node")
    s = host.sched()
    if s is None:
        return Check("sched.policy", "skip", "unknown", why)
    value = f"{s['policy']} priority {s['priority']} nice {s['nice']}"
    if s["policy"] in ("SCHED_FIFO", "SCHED_RR"):
        return Check("sched.policy", "fail", value, why, "run training under SCHED_OTHER: drop the chrt wrapper "
                     "(chrt -o -p 0 PID switches a running process back)")
    if host.read_int("/proc/sys/kernel/sched_rt_runtime_us") == -1:
        return Check("sched.policy", "warn", value + "; RT throttling off", why + "; with "
                     "kernel.sched_rt_runtime_us=-1 nothing stops a real-time task from taking a CPU for good",
                     "sysctl -w kernel.sched_rt_runtime_us=950000 (the kernel default)")
    return Check("sched.policy", "ok", value, why)


@check("sched.granularity", "cpu", mismatch="warn")
def sched_granularity(host: Host, ctx: Context) -> Check:
    why = ("the scheduler's minimum time slice: the seed's 99 ns makes the kernel switch tasks constantly, "
           "so ranks spend their time in context switches instead of compute")
    for path in GRANULARITY_FILES:
        ns = host.read_int(path)
        if ns is None:
            continue
        value = f"{ns} ns ({path.rsplit('/', 1)[1]})"
        fix = f"echo 3000000 > {path} (or reboot: the kernel's default is about 0.75-3 ms)"
        if ns < GRANULARITY_FAIL_NS:
            return Check("sched.granularity", "fail", value, why, fix, {"ns": ns})
        if ns < GRANULARITY_WARN_NS:
            return Check("sched.granularity", "warn", value, why, fix, {"ns": ns})
        return Check("sched.granularity", "ok", value, why, data={"ns": ns})
    return Check("sched.granularity", "skip", "not readable", why + " (debugfs not mounted: the kernel default "
                 "applies unless someone changed it)")
