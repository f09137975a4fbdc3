//! CPU accounting per process: this process and its waited-for children (the external tools),
//! the PostgreSQL server (postmaster and backends, from `/proc`), the Redis server (`INFO
//! cpu`), and the whole machine (`/proc/stat`); and the wait for a quiet machine before each
//! figure.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use pgfence_bench::parse_proc_stat;
use sqlx::PgPool;

use crate::measure::Sample;

/// CPU counters from `/proc`, in clock ticks (`USER_HZ`, 100 per second on Linux).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CpuSnap {
    /// This process (all threads).
    own: u64,
    /// Waited-for children (pgbench, redis-benchmark).
    children: u64,
    /// The machine: busy ticks summed over CPUs.
    busy: u64,
    /// The PostgreSQL server: its postmaster and backends, exited backends included (they
    /// are added to the postmaster's children time when reaped). `None` when it is not a
    /// local process.
    pg: Option<u64>,
}

/// Microseconds per `USER_HZ` tick.
const TICK_US: f64 = 10_000.0;

/// PID of the benchmarked PostgreSQL's postmaster, when it runs on this machine.
static POSTMASTER: OnceLock<u32> = OnceLock::new();

/// `(ppid, utime + stime, cutime + cstime)` of process `pid`, from `/proc/<pid>/stat`.
fn proc_times(pid: &str) -> Option<(u32, u64, u64)> {
    parse_proc_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// CPU ticks of the postmaster `postmaster` and its children.
fn postgres_ticks(postmaster: u32) -> Option<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if let Some((ppid, own, children)) = proc_times(pid)
            && (ppid == postmaster || pid.parse() == Ok(postmaster))
        {
            total += own + children;
        }
    }
    Some(total)
}

/// The counters now; `None` without `/proc`.
pub(crate) fn cpu_snap() -> Option<CpuSnap> {
    let (_, own, children) = proc_times("self")?;
    let machine = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu: Vec<u64> = machine
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal ...
    let at = |i: usize| cpu.get(i).copied().unwrap_or(0);
    Some(CpuSnap {
        own,
        children,
        busy: at(0) + at(1) + at(2) + at(5) + at(6) + at(7),
        pg: POSTMASTER.get().and_then(|pm| postgres_ticks(*pm)),
    })
}

/// Finds the server's postmaster among this machine's processes (the parent of our backend),
/// for the PostgreSQL CPU figures; leaves [`POSTMASTER`] unset for a remote server.
pub(crate) async fn find_postmaster(admin: &PgPool) {
    let Ok(backend) = sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
        .fetch_one(admin)
        .await
    else {
        return;
    };
    let is_postgres = |pid: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "postgres")
    };
    let backend = backend.to_string();
    if let Some((ppid, _, _)) = proc_times(&backend)
        && is_postgres(&backend)
        && is_postgres(&ppid.to_string())
    {
        let _ = POSTMASTER.set(ppid);
    }
}

impl Sample {
    /// Machine CPU per operation not accounted to the client or the servers.
    pub(crate) fn other_cpu_us_per_op(&self) -> Option<f64> {
        let known = self.client_cpu_us_per_op?
            + self.pg_server_us_per_op.unwrap_or(0.0)
            + self.redis_server_us_per_op.unwrap_or(0.0)
            + self.etcd_server_us_per_op.unwrap_or(0.0)
            + self.zk_server_us_per_op.unwrap_or(0.0);
        Some((self.machine_cpu_us_per_op? - known).max(0.0))
    }

    /// Fills the CPU figures from two snapshots around `ops` operations in `seconds`;
    /// `children` when the client was a child process.
    pub(crate) fn cpu(
        &mut self,
        before: Option<CpuSnap>,
        after: Option<CpuSnap>,
        ops: u64,
        children: bool,
    ) {
        let (Some(a), Some(b)) = (before, after) else {
            return;
        };
        if ops == 0 || self.seconds <= 0.0 {
            return;
        }
        let client = if children {
            b.children.saturating_sub(a.children)
        } else {
            b.own.saturating_sub(a.own)
        };
        let busy = b.busy.saturating_sub(a.busy);
        let ops = ops as f64;
        if let (Some(pa), Some(pb)) = (a.pg, b.pg) {
            self.pg_server_us_per_op = Some(pb.saturating_sub(pa) as f64 * TICK_US / ops);
        }
        self.client_cpu_us_per_op = Some(client as f64 * TICK_US / ops);
        self.machine_cpu_us_per_op = Some(busy as f64 * TICK_US / ops);
        self.busy_cpus = Some(busy as f64 * TICK_US / 1e6 / self.seconds);
    }

    /// Fills `redis_server_us_per_op` from two [`redis_usec`] readings around `ops`.
    pub(crate) fn redis_cpu(&mut self, before: Option<f64>, after: Option<f64>, ops: u64) {
        if let (Some(a), Some(b)) = (before, after)
            && ops > 0
        {
            self.redis_server_us_per_op = Some((b - a) / ops as f64);
        }
    }
}

/// The Redis server's CPU time so far, in microseconds (`used_cpu_user` + `used_cpu_sys`
/// of `INFO cpu`: the whole server process).
pub(crate) async fn redis_usec(conn: &mut redis::aio::MultiplexedConnection) -> Option<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await.ok()?;
    let get = |key: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    Some((get("used_cpu_user:")? + get("used_cpu_sys:")?) * 1e6)
}

/// Busy CPUs above which the machine is not quiet (our servers idle between measurements).
const QUIET_CPUS: f64 = 0.35;

/// Waits (up to `max_secs`, `PGFENCE_BENCH_QUIET_WAIT`) until the machine's busy CPUs over
/// 250 ms drop below [`QUIET_CPUS`], so that a measurement does not start on top of someone
/// else's build; returns the wait.
pub(crate) async fn quiet_gate(max_secs: u64) -> f64 {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(max_secs) {
        let Some(a) = cpu_snap() else { break };
        tokio::time::sleep(Duration::from_millis(250)).await;
        let Some(b) = cpu_snap() else { break };
        if b.busy.saturating_sub(a.busy) as f64 * TICK_US / 250_000.0 < QUIET_CPUS {
            break;
        }
    }
    start.elapsed().as_secs_f64()
}
