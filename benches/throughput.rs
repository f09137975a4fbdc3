//! `cargo bench --bench throughput`: pgfence's write and lock throughput next to the baselines
//! that bound it, measured in one run on the same servers.
//!
//! Sections (run all, or name some: `cargo bench --bench throughput -- write acquire`):
//!
//! - `write`: (1a) [`Repository::update`] on a guarded table; (1b) raw sqlx
//!   `UPDATE .. SET payload = $1 WHERE id = $2` on an identical unguarded table (no `fence`
//!   column, no trigger); (1c) raw sqlx running the exact SQL text the repository sends, read
//!   back from `pg_prepared_statements` after one real `Repository::update`; (1d) raw sqlx
//!   `UPDATE .. WHERE id = $1 AND fence < $3` on the guarded table, the same statement as a
//!   person would write it; (1e) 1a through a pool with sqlx's default options.
//! - `pgbench`: 1b, 1d and 1c through `pgbench -M prepared`, the C client as a ceiling.
//! - `acquire`: [`Issuer::acquire`] on a fresh resource each time vs `redis-benchmark` sending
//!   the same Lua script by `EVALSHA` on fresh random keys; acquire+release cycles (also with
//!   the issuer on one multiplexed connection) vs the `rslock` crate's lock+unlock and a
//!   hand-rolled `SET NX PX` + Lua compare-and-delete.
//! - `job`: acquire → fenced write → release.
//! - `storm`: stale writes (every one rejected and audited; the audit row count is checked),
//!   then all-fresh writes and a 10 % stale mix.
//! - `scaling`: 1a at several concurrencies, pool size = concurrency (at most 64).
//!
//! Every figure waits for an idle machine first, and records CPU time per operation of the
//! client, the PostgreSQL server, the Redis server and everything else (see BENCHMARKS.md).
//! The tables are written once, unmeasured, before round 1, and vacuumed before every figure.
//!
//! Fairness rules: every client gets the same pool size / connection count and concurrency;
//! Postgres pools are opened with `min_connections = max_connections` and
//! `test_before_acquire(false)` (1e shows what sqlx's default costs); keys are uniform random,
//! partitioned so that task `i` (pgbench client `i`) only touches ids `≡ i (mod tasks)`, which
//! keeps every write's token newer than its row's fence (tokens come from one global
//! `AtomicI64`; pgbench counts per client from a start above every fence).
//!
//! Servers: `DATABASE_URL` / `REDIS_URL` when set, else throwaway servers
//! ([`pgfence::ephemeral::Server`]). A fresh database is created (and dropped at the end) and
//! migrated with [`pgfence::migrate`].
//!
//! Settings (environment): `PGFENCE_BENCH_SECS` (3), `PGFENCE_BENCH_WARMUP` (1),
//! `PGFENCE_BENCH_TASKS` (16), `PGFENCE_BENCH_POOL` (= tasks), `PGFENCE_BENCH_ROWS` (10000),
//! `PGFENCE_BENCH_ROUNDS` (3; figures are medians over rounds), `PGFENCE_BENCH_SCALING`
//! (`1,4,16,64`), `PGFENCE_BENCH_WORKERS` (tokio worker threads, default: CPUs),
//! `PGFENCE_BENCH_JSON` (default `$CARGO_TARGET_DIR/bench-throughput.json`, else
//! `target/bench-throughput.json`).
//!
//! Run without `--bench` (as `cargo test --all-targets` does), it only prints how to run it.

// A benchmark's report is its standard output.
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use pgfence::ephemeral::Server;
use pgfence::{FenceToken, Fencing, Issuer, Repository, Resource, TableName};
use redis::aio::ConnectionManager;
use serde_json::{Value as Json, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, SqlSafeStr, SqlStr};

/// The acquire script, byte for byte what [`Issuer::acquire`] sends.
const ACQUIRE_LUA: &str = include_str!("../src/lua/acquire.lua");

/// The hand-rolled baseline's release: delete the key only if it still holds our value.
const COMPARE_DEL_LUA: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

/// Every row's payload (and every write's): 32 bytes, as in the initial data.
const PAYLOAD: &str = "0123456789abcdef0123456789abcdef";

/// Lease TTL for every lock taken here.
const LEASE_TTL: Duration = Duration::from_secs(30);

/// What [`Repository::update`] sends for [`GuardedRow`], rebuilt by hand from
/// `Statements::build` in `src/repository.rs`. The bench uses the text it reads back from the
/// server; this copy only lets the report say whether the two still agree.
const REPO_UPDATE_SQL: &str = "UPDATE \"public\".\"bench_guarded\" SET \"payload\" = $2, \
    \"fence\" = $3 WHERE \"id\" OPERATOR(pg_catalog.=) $1 AND \"fence\" OPERATOR(pg_catalog.<) $3";

/// 1b: the plain update, on the unguarded table.
const PLAIN_UPDATE_SQL: &str = "UPDATE bench_plain SET payload = $1 WHERE id = $2";

/// 1d: the repository's fenced update as a person would write it (unquoted, unqualified).
const FENCED_UPDATE_SQL: &str =
    "UPDATE bench_guarded SET payload = $2, fence = $3 WHERE id = $1 AND fence < $3";

/// The last token handed out; every fresh write takes the next one.
static TOKENS: AtomicI64 = AtomicI64::new(0);

/// Makes resource names unique across measurements (and rounds).
static NONCE: AtomicU64 = AtomicU64::new(0);

fn next_token() -> FenceToken {
    FenceToken::new(TOKENS.fetch_add(1, Ordering::Relaxed) + 1).expect("tokens start at 1")
}

fn stale_token() -> FenceToken {
    FenceToken::new(1).expect("1 is a token")
}

/// A row of the guarded table, for the repository.
#[derive(Clone, Debug)]
struct GuardedRow {
    id: i32,
    payload: String,
}

pgfence::fenced_table!(GuardedRow {
    table: "bench_guarded",
    key: id: i32,
    columns: [payload],
});

/// A row of the job-cycle table (guarded, fences start at 0, tokens come from Redis).
#[derive(Clone, Debug)]
struct JobRow {
    id: i32,
    payload: String,
}

pgfence::fenced_table!(JobRow {
    table: "bench_jobs",
    key: id: i32,
    columns: [payload],
});

// ---------------------------------------------------------------------------------------------
// Configuration

/// Benchmark settings, from the environment.
#[derive(Clone, Debug, serde::Serialize)]
struct Config {
    secs: u64,
    warmup: u64,
    tasks: usize,
    pool: u32,
    rows: i32,
    rounds: usize,
    scaling: Vec<usize>,
    workers: usize,
    json: PathBuf,
    sections: Vec<String>,
}

const SECTIONS: &[&str] = &["write", "pgbench", "acquire", "job", "storm", "scaling"];

fn env_or<T: FromStr>(name: &str, default: T) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().map_err(|e| anyhow!("{name}={v:?}: {e}")),
        _ => Ok(default),
    }
}

impl Config {
    fn from_env(args: &[String]) -> Result<Self> {
        let cpus = std::thread::available_parallelism().map_or(2, usize::from);
        let tasks: usize = env_or("PGFENCE_BENCH_TASKS", 16)?;
        let scaling = env_or("PGFENCE_BENCH_SCALING", "1,4,16,64".to_owned())?
            .split(',')
            .map(|s| s.trim().parse::<usize>().context("PGFENCE_BENCH_SCALING"))
            .collect::<Result<Vec<_>>>()?;
        let json = match std::env::var_os("PGFENCE_BENCH_JSON") {
            Some(p) => PathBuf::from(p),
            None => std::env::var_os("CARGO_TARGET_DIR")
                .map_or_else(|| PathBuf::from("target"), PathBuf::from)
                .join("bench-throughput.json"),
        };
        let sections: Vec<String> = args
            .iter()
            .filter(|a| !a.starts_with('-'))
            .cloned()
            .collect();
        if let Some(bad) = sections.iter().find(|s| !SECTIONS.contains(&s.as_str())) {
            bail!("unknown section {bad:?}; sections are {SECTIONS:?}");
        }
        let cfg = Self {
            secs: env_or("PGFENCE_BENCH_SECS", 3)?,
            warmup: env_or("PGFENCE_BENCH_WARMUP", 1)?,
            tasks,
            pool: env_or("PGFENCE_BENCH_POOL", u32::try_from(tasks)?)?,
            rows: env_or("PGFENCE_BENCH_ROWS", 10_000)?,
            rounds: env_or("PGFENCE_BENCH_ROUNDS", 3)?,
            scaling,
            workers: env_or("PGFENCE_BENCH_WORKERS", cpus)?,
            json,
            sections,
        };
        let max_tasks = cfg
            .scaling
            .iter()
            .copied()
            .chain([cfg.tasks])
            .max()
            .unwrap_or(1);
        if cfg.secs == 0 || cfg.warmup == 0 || cfg.tasks == 0 || cfg.pool == 0 || cfg.rounds == 0 {
            bail!("PGFENCE_BENCH_SECS, _WARMUP, _TASKS, _POOL and _ROUNDS must be at least 1");
        }
        if cfg.scaling.contains(&0) || usize::try_from(cfg.rows)? < max_tasks {
            bail!("every concurrency must be between 1 and PGFENCE_BENCH_ROWS");
        }
        Ok(cfg)
    }

    fn runs(&self, section: &str) -> bool {
        self.sections.is_empty() || self.sections.iter().any(|s| s == section)
    }
}

// ---------------------------------------------------------------------------------------------
// The measuring loop

/// What one operation came to.
enum Outcome {
    /// Done as intended (write applied, lock taken...).
    Applied,
    /// Refused as designed: a stale token, or a lock held by someone else.
    Rejected,
    /// Anything else.
    Failed(String),
}

impl<T> From<pgfence::Result<T>> for Outcome {
    fn from(r: pgfence::Result<T>) -> Self {
        match r {
            Ok(_) => Outcome::Applied,
            Err(e) if e.is_stale() => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// A load: per-task state and one operation, repeated by every task until time is up.
trait Workload: Send + Sync + 'static {
    /// Per-task state (key generator, row buffer...).
    type State: Send + 'static;
    /// The state of task `task`.
    fn state(&self, task: usize) -> Self::State;
    /// One operation.
    fn op(&self, state: &mut Self::State) -> impl Future<Output = Outcome> + Send;
}

/// Which count a measurement reports as its throughput.
#[derive(Clone, Copy, Debug)]
enum Metric {
    Applied,
    Rejected,
}

/// One task's counts. `window` counts only operations that completed during the measured
/// window; `total` counts everything, warm-up included (for the audit check).
#[derive(Default)]
struct Tally {
    window: [u64; 3],
    total: [u64; 3],
    first_error: Option<String>,
    latencies_us: Vec<u32>,
}

impl Tally {
    fn record(&mut self, in_window: bool, took: Duration, outcome: Outcome) {
        let slot = match outcome {
            Outcome::Applied => 0,
            Outcome::Rejected => 1,
            Outcome::Failed(e) => {
                self.first_error.get_or_insert(e);
                2
            }
        };
        self.total[slot] += 1;
        if in_window {
            self.window[slot] += 1;
            self.latencies_us
                .push(u32::try_from(took.as_micros()).unwrap_or(u32::MAX));
        }
    }

    fn merge(&mut self, other: Tally) {
        for i in 0..3 {
            self.window[i] += other.window[i];
            self.total[i] += other.total[i];
        }
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        self.latencies_us.extend(other.latencies_us);
    }
}

/// One measured figure.
#[derive(Clone, Debug, Default, serde::Serialize)]
struct Sample {
    /// The headline rate (operations per second), `None` when the row was skipped.
    ops_per_sec: Option<f64>,
    /// Measured window in seconds.
    seconds: f64,
    /// Applied / rejected / failed operations in the window.
    applied: u64,
    rejected: u64,
    failed: u64,
    /// Rejections over the whole measurement, warm-up included.
    rejected_total: u64,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    /// Set by the external tools (pgbench's latency average, redis-benchmark's).
    avg_ms: Option<f64>,
    /// Operations over the whole measurement, warm-up included.
    total_ops: u64,
    /// CPU time of the client (this process, or the external tool) per operation, in the
    /// measured window.
    client_cpu_us_per_op: Option<f64>,
    /// CPU time of the whole machine (client, servers, anything else running) per operation.
    machine_cpu_us_per_op: Option<f64>,
    /// Average busy CPUs over the window (of `available_parallelism`).
    busy_cpus: Option<f64>,
    /// Seconds spent waiting for the machine to go quiet before starting.
    quiet_wait_s: f64,
    /// CPU time of the PostgreSQL server per operation (local servers only).
    pg_server_us_per_op: Option<f64>,
    /// CPU time of the Redis server per operation (`INFO cpu`), for Redis rows.
    redis_server_us_per_op: Option<f64>,
    note: Option<String>,
}

impl Sample {
    fn skipped(note: impl Into<String>) -> Self {
        Self {
            note: Some(note.into()),
            ..Self::default()
        }
    }
}

/// CPU counters from `/proc`, in clock ticks (`USER_HZ`, 100 per second on Linux).
#[derive(Clone, Copy, Debug)]
struct CpuSnap {
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
static POSTMASTER: std::sync::OnceLock<u32> = std::sync::OnceLock::new();

/// `(ppid, utime + stime, cutime + cstime)` of process `pid`, from `/proc/<pid>/stat`.
fn proc_times(pid: &str) -> Option<(u32, u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name: state ppid ...; utime is field 14 of the line.
    let fields: Vec<&str> = stat
        .get(stat.rfind(')')? + 2..)?
        .split_whitespace()
        .collect();
    let num = |i: usize| fields.get(i)?.parse::<u64>().ok();
    Some((
        fields.get(1)?.parse().ok()?,
        num(11)? + num(12)?,
        num(13)? + num(14)?,
    ))
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

fn cpu_snap() -> Option<CpuSnap> {
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

impl Sample {
    /// Machine CPU per operation not accounted to the client or the servers.
    fn other_cpu_us_per_op(&self) -> Option<f64> {
        let known = self.client_cpu_us_per_op?
            + self.pg_server_us_per_op.unwrap_or(0.0)
            + self.redis_server_us_per_op.unwrap_or(0.0);
        Some((self.machine_cpu_us_per_op? - known).max(0.0))
    }

    /// Fills the CPU figures from two snapshots around `ops` operations in `seconds`;
    /// `children` when the client was a child process.
    fn cpu(&mut self, before: Option<CpuSnap>, after: Option<CpuSnap>, ops: u64, children: bool) {
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
}

/// Busy CPUs above which the machine is not quiet (our servers idle between measurements).
const QUIET_CPUS: f64 = 0.35;

/// Waits (up to 30 s) until the machine's busy CPUs over 250 ms drop below [`QUIET_CPUS`], so
/// that a measurement does not start on top of someone else's build; returns the wait.
async fn quiet_gate() -> f64 {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        let Some(a) = cpu_snap() else { break };
        tokio::time::sleep(Duration::from_millis(250)).await;
        let Some(b) = cpu_snap() else { break };
        if b.busy.saturating_sub(a.busy) as f64 * TICK_US / 250_000.0 < QUIET_CPUS {
            break;
        }
    }
    start.elapsed().as_secs_f64()
}

/// Shared start/stop flags of one measurement.
#[derive(Default)]
struct Gate {
    measuring: AtomicBool,
    stop: AtomicBool,
}

/// Runs `work` on `tasks` tokio tasks: `cfg.warmup` seconds unmeasured, then `cfg.secs`
/// measured.
async fn measure<W: Workload>(
    cfg: &Config,
    tasks: usize,
    metric: Metric,
    work: W,
) -> Result<Sample> {
    let quiet_wait_s = quiet_gate().await;
    let work = Arc::new(work);
    let gate = Arc::new(Gate::default());
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let (work, gate) = (work.clone(), gate.clone());
            tokio::spawn(async move {
                let mut state = work.state(task);
                let mut tally = Tally::default();
                while !gate.stop.load(Ordering::Relaxed) {
                    let start = Instant::now();
                    let outcome = work.op(&mut state).await;
                    let in_window = gate.measuring.load(Ordering::Relaxed);
                    tally.record(in_window, start.elapsed(), outcome);
                }
                tally
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(cfg.warmup)).await;
    gate.measuring.store(true, Ordering::Relaxed);
    let (started, cpu_before) = (Instant::now(), cpu_snap());
    tokio::time::sleep(Duration::from_secs(cfg.secs)).await;
    gate.measuring.store(false, Ordering::Relaxed);
    let (seconds, cpu_after) = (started.elapsed().as_secs_f64(), cpu_snap());
    gate.stop.store(true, Ordering::Relaxed);
    let mut all = Tally::default();
    for h in handles {
        all.merge(h.await.context("a benchmark task panicked")?);
    }
    all.latencies_us.sort_unstable();
    let pct = |p: usize| {
        let v = &all.latencies_us;
        (!v.is_empty()).then(|| f64::from(v[(v.len() - 1) * p / 100]) / 1000.0)
    };
    let [applied, rejected, failed] = all.window;
    let headline = match metric {
        Metric::Applied => applied,
        Metric::Rejected => rejected,
    };
    let mut sample = Sample {
        ops_per_sec: Some(headline as f64 / seconds),
        seconds,
        applied,
        rejected,
        failed,
        rejected_total: all.total[1],
        p50_ms: pct(50),
        p99_ms: pct(99),
        total_ops: all.total.iter().sum(),
        quiet_wait_s,
        note: all.first_error.map(|e| format!("first error: {e}")),
        ..Sample::default()
    };
    sample.cpu(cpu_before, cpu_after, applied + rejected + failed, false);
    Ok(sample)
}

/// SplitMix64: a tiny, fast, seedable generator; good enough to pick keys.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (multiply-shift; the bias is far below what matters here).
    fn below(&mut self, n: u64) -> u64 {
        u64::try_from((u128::from(self.next()) * u128::from(n)) >> 64).expect("less than n")
    }
}

/// Uniform random ids of the rows task `task` owns: `1 + task + tasks * k` for `k` in
/// `0..rows / tasks` — the same set the pgbench scripts draw from for client `task`.
struct Keys {
    rng: SplitMix64,
    base: i64,
    stride: i64,
    slots: u64,
}

impl Keys {
    fn new(task: usize, tasks: usize, rows: i32) -> Self {
        let tasks = i64::try_from(tasks).expect("task count fits i64");
        let task = i64::try_from(task).expect("task index fits i64");
        Self {
            rng: SplitMix64(
                0x5EED_0000
                    ^ (u64::try_from(task).expect("non-negative") << 32)
                    ^ NONCE.fetch_add(1, Ordering::Relaxed),
            ),
            base: 1 + task,
            stride: tasks,
            slots: u64::try_from(i64::from(rows) / tasks).expect("rows >= tasks"),
        }
    }

    fn next(&mut self) -> i32 {
        let k = i64::try_from(self.rng.below(self.slots)).expect("slots fit i64");
        i32::try_from(self.base + self.stride * k).expect("ids fit i32")
    }
}

// ---------------------------------------------------------------------------------------------
// Workloads

/// 1a / 5 / 6: [`Repository::update`] on the guarded table. Every `stale_every`-th write (0:
/// none) presents token 1, which every row's fence has passed by the time it is used.
struct RepoWrite {
    pool: PgPool,
    repo: Repository<GuardedRow>,
    tasks: usize,
    rows: i32,
    stale_every: u64,
    /// Audit context (resource and holder) sent with every write, as an application would.
    context: Option<Resource>,
}

impl Workload for RepoWrite {
    type State = (Keys, GuardedRow, u64);

    fn state(&self, task: usize) -> Self::State {
        let row = GuardedRow {
            id: 0,
            payload: PAYLOAD.to_owned(),
        };
        (Keys::new(task, self.tasks, self.rows), row, 0)
    }

    async fn op(&self, (keys, row, n): &mut Self::State) -> Outcome {
        row.id = keys.next();
        *n += 1;
        let token = if self.stale_every > 0 && *n % self.stale_every == 0 {
            stale_token()
        } else {
            next_token()
        };
        let fencing = match &self.context {
            Some(r) => Fencing::new(token)
                .resource(r.clone())
                .holder("pgfence-bench"),
            None => Fencing::new(token),
        };
        self.repo.update(&self.pool, fencing, row).await.into()
    }
}

/// 1b: the plain update on the unguarded table.
struct PlainUpdate {
    pool: PgPool,
    tasks: usize,
    rows: i32,
}

impl Workload for PlainUpdate {
    type State = (Keys, String);

    fn state(&self, task: usize) -> Self::State {
        (Keys::new(task, self.tasks, self.rows), PAYLOAD.to_owned())
    }

    async fn op(&self, (keys, payload): &mut Self::State) -> Outcome {
        let done = sqlx::query(PLAIN_UPDATE_SQL)
            .bind(&*payload)
            .bind(keys.next())
            .execute(&self.pool)
            .await;
        match done {
            Ok(d) if d.rows_affected() == 1 => Outcome::Applied,
            Ok(_) => Outcome::Failed("no row updated".into()),
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// 1c / 1d: a fenced `UPDATE` sent by raw sqlx with `($1 id, $2 payload, $3 token)`: the
/// repository's own SQL text (1c) or the same statement written by hand (1d).
struct RawFencedSql {
    pool: PgPool,
    sql: SqlStr,
    tasks: usize,
    rows: i32,
}

impl Workload for RawFencedSql {
    type State = (Keys, String);

    fn state(&self, task: usize) -> Self::State {
        (Keys::new(task, self.tasks, self.rows), PAYLOAD.to_owned())
    }

    async fn op(&self, (keys, payload): &mut Self::State) -> Outcome {
        let done = sqlx::query(self.sql.clone())
            .bind(keys.next())
            .bind(&*payload)
            .bind(next_token().get())
            .execute(&self.pool)
            .await;
        match done {
            Ok(d) if d.rows_affected() == 1 => Outcome::Applied,
            Ok(_) => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// 3a: one acquire per operation, each on a resource never used before (fresh lock key and
/// fresh counter, like `redis-benchmark` on random keys). Leases are left to expire.
struct AcquireFresh {
    issuer: Issuer,
    prefix: String,
}

impl Workload for AcquireFresh {
    type State = (usize, u64);

    fn state(&self, task: usize) -> Self::State {
        (task, 0)
    }

    async fn op(&self, (task, seq): &mut Self::State) -> Outcome {
        *seq += 1;
        let resource = match Resource::new(format!("{}:{task}:{seq}", self.prefix)) {
            Ok(r) => r,
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        match self.issuer.acquire(&resource, LEASE_TTL).await {
            Ok(Some(_)) => Outcome::Applied,
            Ok(None) => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// 3c: acquire + release of one resource per task.
struct IssuerCycle<C = pgfence::RedisConnections> {
    issuer: Issuer<C>,
    prefix: String,
}

impl<C> Workload for IssuerCycle<C>
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
{
    type State = Resource;

    fn state(&self, task: usize) -> Self::State {
        Resource::new(format!("{}:{task}", self.prefix)).expect("valid resource name")
    }

    async fn op(&self, resource: &mut Self::State) -> Outcome {
        match self.issuer.acquire(resource, LEASE_TTL).await {
            Ok(Some(lease)) => match self.issuer.release(&lease).await {
                Ok(pgfence::LeaseState::Held) => Outcome::Applied,
                Ok(state) => Outcome::Failed(format!("release found {state:?}")),
                Err(e) => Outcome::Failed(e.to_string()),
            },
            Ok(None) => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// 3d: `rslock` lock + unlock of one resource per task (single server, so quorum 1).
struct RslockCycle {
    manager: rslock::LockManager,
    prefix: String,
}

impl Workload for RslockCycle {
    type State = Vec<u8>;

    fn state(&self, task: usize) -> Self::State {
        format!("{}:{task}", self.prefix).into_bytes()
    }

    async fn op(&self, resource: &mut Self::State) -> Outcome {
        match self.manager.lock(resource.as_slice(), LEASE_TTL).await {
            Ok(lock) => {
                self.manager.unlock(&lock).await;
                Outcome::Applied
            }
            Err(rslock::LockError::Unavailable) => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

static COMPARE_DEL: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(COMPARE_DEL_LUA));

/// 3e: the minimal lock without a token: `SET key owner NX PX ttl`, then a Lua
/// compare-and-delete, on the same kind of connection the issuer uses.
struct HandRolledCycle {
    conn: ConnectionManager,
    prefix: String,
}

impl Workload for HandRolledCycle {
    type State = String;

    fn state(&self, task: usize) -> Self::State {
        format!("{}:{task}", self.prefix)
    }

    async fn op(&self, key: &mut Self::State) -> Outcome {
        let mut conn = self.conn.clone();
        let owner = format!("{:032x}", rand::random::<u128>());
        let ttl_ms = u64::try_from(LEASE_TTL.as_millis()).expect("ttl fits u64");
        let set: redis::RedisResult<Option<String>> = redis::cmd("SET")
            .arg(&*key)
            .arg(&owner)
            .arg("NX")
            .arg("PX")
            .arg(ttl_ms)
            .query_async(&mut conn)
            .await;
        match set {
            Ok(Some(_)) => {}
            Ok(None) => return Outcome::Rejected,
            Err(e) => return Outcome::Failed(e.to_string()),
        }
        let deleted: redis::RedisResult<i64> = COMPARE_DEL
            .key(&*key)
            .arg(&owner)
            .invoke_async(&mut conn)
            .await;
        match deleted {
            Ok(1) => Outcome::Applied,
            Ok(n) => Outcome::Failed(format!("compare-del returned {n}")),
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// 4: a job: acquire the task's resource, write one of its rows with the lease's token,
/// release.
struct JobCycle {
    issuer: Issuer,
    pool: PgPool,
    repo: Repository<JobRow>,
    prefix: String,
    tasks: usize,
    rows: i32,
}

impl Workload for JobCycle {
    type State = (Keys, JobRow, Resource);

    fn state(&self, task: usize) -> Self::State {
        let row = JobRow {
            id: 0,
            payload: PAYLOAD.to_owned(),
        };
        let resource = Resource::new(format!("{}:{task}", self.prefix)).expect("valid name");
        (Keys::new(task, self.tasks, self.rows), row, resource)
    }

    async fn op(&self, (keys, row, resource): &mut Self::State) -> Outcome {
        let lease = match self.issuer.acquire(resource, LEASE_TTL).await {
            Ok(Some(lease)) => lease,
            Ok(None) => return Outcome::Failed("lock held".into()),
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        row.id = keys.next();
        let written: Outcome = self.repo.update(&self.pool, &lease, row).await.into();
        match self.issuer.release(&lease).await {
            Ok(pgfence::LeaseState::Held) => written,
            Ok(state) => Outcome::Failed(format!("release found {state:?}")),
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Servers, database, tools

/// What every section needs.
struct Env {
    cfg: Config,
    /// Connect options of the bench database.
    db: PgConnectOptions,
    /// The bench database as a URL, for pgbench.
    db_url: String,
    /// Setup / bookkeeping pool on the bench database.
    admin: PgPool,
    redis_url: String,
    /// Prefix of every Redis key and resource this run creates.
    run_id: String,
    /// The repository's update SQL, as the server received it.
    repo_sql: String,
    pgbench: Option<PathBuf>,
    redis_benchmark: Option<PathBuf>,
    /// Scratch directory for pgbench scripts.
    scratch: PathBuf,
}

/// `url` with its database replaced by `db` (user, host, port and parameters kept).
fn with_database(url: &str, db: &str) -> Result<String> {
    let scheme_end = url.find("://").context("DATABASE_URL is not a URL")? + 3;
    let rest = &url[scheme_end..];
    let (main, query) = rest.find('?').map_or((rest, ""), |i| rest.split_at(i));
    let authority = main.find('/').map_or(main, |i| &main[..i]);
    Ok(format!("{}{authority}/{db}{query}", &url[..scheme_end]))
}

/// `name` on `PATH`, then in `extra` directories.
fn find_tool(name: &str, extra: &[PathBuf]) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain(extra.iter().cloned())
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// `/usr/lib/postgresql/*/bin`, newest version first.
fn postgres_bindirs() -> Vec<PathBuf> {
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .collect();
    dirs.sort_by_key(|d| std::cmp::Reverse(d.0));
    dirs.into_iter().map(|(_, d)| d).collect()
}

async fn run_sql(pool: &PgPool, sql: &str) -> Result<()> {
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .with_context(|| format!("running {sql}"))?;
    Ok(())
}

/// A pool of `size` connections opened up front, without the per-checkout ping.
async fn tuned_pool(env: &Env, size: u32) -> Result<PgPool> {
    Ok(PgPoolOptions::new()
        .max_connections(size)
        .min_connections(size)
        .test_before_acquire(false)
        .connect_with(env.db.clone())
        .await?)
}

/// Creates and fills the tables, guards two of them. Autovacuum is off for them: [`prep`]
/// vacuums before every measurement instead, so that no measurement gets a vacuum mid-run.
async fn create_tables(admin: &PgPool, rows: i32) -> Result<()> {
    for table in ["bench_guarded", "bench_plain", "bench_jobs"] {
        run_sql(
            admin,
            &format!(
                "CREATE TABLE {table} (id integer PRIMARY KEY, payload text NOT NULL)
                     WITH (autovacuum_enabled = off);
                 INSERT INTO {table} SELECT g, '{PAYLOAD}' FROM generate_series(1, {rows}) g;"
            ),
        )
        .await?;
    }
    for table in ["bench_guarded", "bench_jobs"] {
        pgfence::guard(admin, &TableName::parse(table)?).await?;
    }
    run_sql(
        admin,
        "VACUUM (ANALYZE) bench_guarded, bench_plain, bench_jobs",
    )
    .await
}

/// Runs one real [`Repository::update`] on a connection and reads the statement it prepared
/// there back from `pg_prepared_statements`.
async fn capture_repo_sql(env_db: &PgConnectOptions) -> Result<String> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(env_db.clone())
        .await?;
    let repo = Repository::<GuardedRow>::new(pool.clone())?;
    let mut conn = pool.acquire().await?;
    let row = GuardedRow {
        id: 1,
        payload: PAYLOAD.to_owned(),
    };
    repo.update(&mut *conn, next_token(), &row).await?;
    let texts: Vec<String> = sqlx::query_scalar(
        "SELECT statement FROM pg_prepared_statements WHERE statement LIKE 'UPDATE \"public\".\"bench_guarded\" %'",
    )
    .fetch_all(&mut *conn)
    .await?;
    drop(conn);
    pool.close().await;
    match texts.as_slice() {
        [sql] => Ok(sql.clone()),
        other => bail!(
            "expected one prepared repository statement, found {}",
            other.len()
        ),
    }
}

/// Vacuums the tables (so every measurement starts from the same table state), asks for a
/// checkpoint (best effort: needs privileges), and moves the token counter past every fence.
async fn prep(env: &Env) -> Result<()> {
    run_sql(
        &env.admin,
        "VACUUM (ANALYZE) bench_guarded, bench_plain, bench_jobs",
    )
    .await?;
    let _ = sqlx::raw_sql("CHECKPOINT").execute(&env.admin).await;
    resync_tokens(env).await
}

async fn resync_tokens(env: &Env) -> Result<()> {
    let max: i64 = sqlx::query_scalar("SELECT coalesce(max(fence), 0) FROM bench_guarded")
        .fetch_one(&env.admin)
        .await?;
    TOKENS.fetch_max(max, Ordering::SeqCst);
    Ok(())
}

async fn audit_rows(env: &Env) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM pgfence.audit")
        .fetch_one(&env.admin)
        .await?)
}

fn prefix(env: &Env, what: &str) -> String {
    format!(
        "{}:{what}:{}",
        env.run_id,
        NONCE.fetch_add(1, Ordering::Relaxed)
    )
}

// ---------------------------------------------------------------------------------------------
// Sections

type Results = BTreeMap<String, Sample>;

/// Records `sample` under `key` and prints a progress line.
fn put(out: &mut Results, round: usize, key: &str, sample: Sample) {
    let rate = sample
        .ops_per_sec
        .map_or_else(|| "skipped".to_owned(), |r| format!("{r:.0}/s"));
    let note = sample.note.as_deref().unwrap_or("");
    eprintln!("  [round {round}] {key:<34} {rate:>10}  {note}");
    out.insert(key.to_owned(), sample);
}

/// Brings the tables to a steady state before anything is measured: the first update of each
/// row in a freshly loaded table is slower (full pages, so no HOT update; on a guarded table
/// the added `fence` column is written for the first time). One unmeasured run of writes on
/// each table, then a vacuum.
async fn condition(env: &Env) -> Result<()> {
    let cfg = &env.cfg;
    let (tasks, rows) = (cfg.tasks, cfg.rows);
    eprintln!("conditioning the tables (unmeasured)");
    let pool = tuned_pool(env, cfg.pool).await?;
    prep(env).await?;
    let repo = Repository::<GuardedRow>::new(pool.clone())?;
    let work = RepoWrite {
        pool: pool.clone(),
        repo,
        tasks,
        rows,
        stale_every: 0,
        context: None,
    };
    measure(cfg, tasks, Metric::Applied, work).await?;
    let work = PlainUpdate {
        pool: pool.clone(),
        tasks,
        rows,
    };
    measure(cfg, tasks, Metric::Applied, work).await?;
    let work = JobCycle {
        issuer: Issuer::connect(&env.redis_url).await?,
        repo: Repository::new(pool.clone())?,
        pool: pool.clone(),
        prefix: format!("{}:job", env.run_id),
        tasks,
        rows,
    };
    measure(cfg, tasks, Metric::Applied, work).await?;
    pool.close().await;
    prep(env).await
}

async fn section_write(env: &Env, round: usize, out: &mut Results) -> Result<()> {
    let cfg = &env.cfg;
    let (tasks, rows) = (cfg.tasks, cfg.rows);
    let pool = tuned_pool(env, cfg.pool).await?;
    let repo = Repository::<GuardedRow>::new(pool.clone())?;
    // Rotate the order by round, so drift (bloat, autovacuum) does not favour one variant.
    for i in 0..4 {
        prep(env).await?;
        let pool = pool.clone();
        let (key, sample) = match (i + round) % 4 {
            0 => {
                let work = RepoWrite {
                    pool,
                    repo: repo.clone(),
                    tasks,
                    rows,
                    stale_every: 0,
                    context: None,
                };
                (
                    "write.repo_update",
                    measure(cfg, tasks, Metric::Applied, work).await?,
                )
            }
            1 => {
                let work = PlainUpdate { pool, tasks, rows };
                (
                    "write.plain_update",
                    measure(cfg, tasks, Metric::Applied, work).await?,
                )
            }
            2 => {
                let sql = AssertSqlSafe(env.repo_sql.clone()).into_sql_str();
                let work = RawFencedSql {
                    pool,
                    sql,
                    tasks,
                    rows,
                };
                (
                    "write.raw_repo_sql",
                    measure(cfg, tasks, Metric::Applied, work).await?,
                )
            }
            _ => {
                let work = RawFencedSql {
                    pool,
                    sql: FENCED_UPDATE_SQL.into_sql_str(),
                    tasks,
                    rows,
                };
                (
                    "write.fenced_plain_sql",
                    measure(cfg, tasks, Metric::Applied, work).await?,
                )
            }
        };
        put(out, round, key, sample);
    }
    pool.close().await;

    // The same repository write through a pool with sqlx's defaults (a ping per checkout).
    prep(env).await?;
    let pool = PgPoolOptions::new()
        .max_connections(cfg.pool)
        .connect_with(env.db.clone())
        .await?;
    let work = RepoWrite {
        repo: Repository::new(pool.clone())?,
        pool: pool.clone(),
        tasks,
        rows,
        stale_every: 0,
        context: None,
    };
    let sample = measure(cfg, tasks, Metric::Applied, work).await?;
    put(out, round, "write.repo_update_default_pool", sample);
    pool.close().await;
    Ok(())
}

/// `n_tup_upd` of `table`, after giving exited backends a moment to flush their statistics.
async fn updates_counted(env: &Env, table: &str) -> Result<i64> {
    tokio::time::sleep(Duration::from_millis(700)).await;
    Ok(sqlx::query_scalar(
        "SELECT coalesce(n_tup_upd, 0) FROM pg_stat_user_tables WHERE relname = $1",
    )
    .bind(table)
    .fetch_one(&env.admin)
    .await?)
}

/// One pgbench run; returns its stdout.
async fn run_pgbench(env: &Env, bin: &Path, script: &Path, secs: u64) -> Result<String> {
    let clients = env.cfg.tasks;
    let threads = env.cfg.workers.clamp(1, clients);
    resync_tokens(env).await?;
    let start_token = TOKENS.load(Ordering::SeqCst) + 1;
    let out = tokio::process::Command::new(bin)
        .args(["-n", "-M", "prepared"])
        .args(["-c", &clients.to_string(), "-j", &threads.to_string()])
        .args(["-T", &secs.to_string()])
        .args(["-D", &format!("tok={start_token}")])
        .args(["-D", &format!("payload={PAYLOAD}")])
        .arg("-f")
        .arg(script)
        .arg(&env.db_url)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "pgbench failed ({}): {}{}",
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    resync_tokens(env).await?;
    Ok(stdout)
}

/// The number after `prefix` on the first line that starts with it.
fn field(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.trim().strip_prefix(prefix))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

async fn pgbench_row(env: &Env, name: &str, table: &str, body: &str) -> Result<Sample> {
    let Some(bin) = &env.pgbench else {
        return Ok(Sample::skipped(
            "pgbench not found (PATH, /usr/lib/postgresql/*/bin)",
        ));
    };
    let cfg = &env.cfg;
    let slots = cfg.rows / i32::try_from(cfg.tasks)?;
    let script = env.scratch.join(format!("{name}.sql"));
    let text = format!(
        "\\set id 1 + :client_id + {tasks} * random(0, {last})\n\\set tok :tok + 1\n{body};\n",
        tasks = cfg.tasks,
        last = slots - 1
    );
    std::fs::write(&script, text)?;
    prep(env).await?;
    run_pgbench(env, bin, &script, cfg.warmup).await?;
    let before = updates_counted(env, table).await?;
    let quiet_wait_s = quiet_gate().await;
    let (started, cpu_before) = (Instant::now(), cpu_snap());
    let stdout = run_pgbench(env, bin, &script, cfg.secs).await?;
    let (seconds, cpu_after) = (started.elapsed().as_secs_f64(), cpu_snap());
    let after = updates_counted(env, table).await?;
    let tps = field(&stdout, "tps =").context("no `tps =` line in pgbench's output")?;
    let processed = field(&stdout, "number of transactions actually processed:").unwrap_or(0.0);
    let failed = field(&stdout, "number of failed transactions:").unwrap_or(0.0);
    let applied_share = if processed > 0.0 {
        (after - before) as f64 / processed
    } else {
        0.0
    };
    let mut sample = Sample {
        ops_per_sec: Some(tps),
        seconds,
        avg_ms: field(&stdout, "latency average ="),
        quiet_wait_s,
        note: Some(format!(
            "{processed:.0} transactions, {failed:.0} failed; rows updated per transaction \
             (pg_stat n_tup_upd) {applied_share:.3}"
        )),
        ..Sample::default()
    };
    // The window includes pgbench's start-up and connections: a slight overestimate per op.
    let ops = format!("{processed:.0}").parse().unwrap_or(0);
    sample.cpu(cpu_before, cpu_after, ops, true);
    Ok(sample)
}

async fn section_pgbench(env: &Env, round: usize, out: &mut Results) -> Result<()> {
    // pgbench gives every `:var` occurrence its own parameter, with no type from the client;
    // the one inside jsonb_build_array(..) needs an explicit int4 (sqlx sends the type).
    let repo_body = env
        .repo_sql
        .replace("jsonb_build_array($1)", "jsonb_build_array(:id::int4)")
        .replace("$1", ":id")
        .replace("$2", ":payload")
        .replace("$3", ":tok");
    if repo_body.contains('$') {
        bail!(
            "unexpected parameter in the repository SQL: {}",
            env.repo_sql
        );
    }
    let rows = [
        (
            "pgbench.plain_update",
            "bench_plain",
            "UPDATE bench_plain SET payload = :payload WHERE id = :id".to_owned(),
        ),
        (
            "pgbench.fenced_plain_sql",
            "bench_guarded",
            "UPDATE bench_guarded SET payload = :payload, fence = :tok WHERE id = :id AND fence < :tok"
                .to_owned(),
        ),
        ("pgbench.repo_sql", "bench_guarded", repo_body),
    ];
    for (key, table, body) in rows {
        let name = key.trim_start_matches("pgbench.");
        let sample = pgbench_row(env, name, table, &body).await?;
        put(out, round, key, sample);
    }
    Ok(())
}

async fn redis_conn(url: &str) -> Result<redis::aio::MultiplexedConnection> {
    Ok(redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?)
}

/// `total_error_replies` from `INFO stats` (Redis 6.2+), if present.
async fn redis_error_replies(conn: &mut redis::aio::MultiplexedConnection) -> Option<u64> {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(conn)
        .await
        .ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("total_error_replies:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The Redis server's CPU time so far, in microseconds (`used_cpu_user` + `used_cpu_sys`
/// of `INFO cpu`: the whole server process).
async fn redis_usec(conn: &mut redis::aio::MultiplexedConnection) -> Option<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await.ok()?;
    let get = |key: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    Some((get("used_cpu_user:")? + get("used_cpu_sys:")?) * 1e6)
}

/// Fills `sample.redis_server_us_per_op` from two [`redis_usec`] readings around `ops`.
fn redis_per_op(sample: &mut Sample, before: Option<f64>, after: Option<f64>, ops: u64) {
    if let (Some(a), Some(b)) = (before, after)
        && ops > 0
    {
        sample.redis_server_us_per_op = Some((b - a) / ops as f64);
    }
}

/// One redis-benchmark run of `EVALSHA acquire.lua` on fresh random keys with `threads`
/// client threads; returns the CSV fields of its result line.
async fn run_redis_benchmark(
    env: &Env,
    bin: &Path,
    sha: &str,
    n: u64,
    threads: usize,
) -> Result<Vec<String>> {
    let tag = prefix(env, "rb");
    let mut cmd = tokio::process::Command::new(bin);
    if threads > 1 {
        cmd.args(["--threads", &threads.to_string()]);
    }
    let out = cmd
        .args(["-u", &env.redis_url, "-c", &env.cfg.tasks.to_string()])
        .args(["-n", &n.to_string(), "-r", "1000000000", "--csv"])
        .args(["EVALSHA", sha, "2"])
        .arg(format!("pgfence:{{{tag}:__rand_int__}}:lock"))
        .arg(format!("pgfence:{{{tag}:__rand_int__}}:fence"))
        .arg("0123456789abcdef0123456789abcdef")
        .arg(LEASE_TTL.as_millis().to_string())
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!("redis-benchmark failed ({}): {stdout}", out.status);
    }
    let line = stdout
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("\"evalsha"))
        .with_context(|| format!("no result line in redis-benchmark's output: {stdout}"))?;
    // The command (first field) has no commas; the rest are numbers.
    Ok(line
        .split(',')
        .map(|f| f.trim_matches('"').to_owned())
        .collect())
}

async fn redis_benchmark_row(env: &Env, threads: usize) -> Result<Sample> {
    let Some(bin) = &env.redis_benchmark else {
        return Ok(Sample::skipped(
            "redis-benchmark not found (PATH, /usr/bin)",
        ));
    };
    let mut conn = redis_conn(&env.redis_url).await?;
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(ACQUIRE_LUA)
        .query_async(&mut conn)
        .await?;
    let errors_before = redis_error_replies(&mut conn).await;
    // Warm-up, which also sizes the measured run to about `secs` seconds.
    let warm = run_redis_benchmark(env, bin, &sha, 20_000, threads).await?;
    let rate: u64 = warm
        .get(1)
        .and_then(|r| r.split('.').next())
        .and_then(|r| r.parse().ok())
        .context("redis-benchmark rps")?;
    let n = (rate * env.cfg.secs).max(20_000);
    let quiet_wait_s = quiet_gate().await;
    let (cpu_before, usec_before) = (cpu_snap(), redis_usec(&mut conn).await);
    let fields = run_redis_benchmark(env, bin, &sha, n, threads).await?;
    let (cpu_after, usec_after) = (cpu_snap(), redis_usec(&mut conn).await);
    let num = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
    let errors = match (errors_before, redis_error_replies(&mut conn).await) {
        (Some(a), Some(b)) => format!("{} error replies", b - a),
        _ => "error replies unknown".to_owned(),
    };
    let rps = num(1).context("redis-benchmark rps")?;
    let mut sample = Sample {
        ops_per_sec: Some(rps),
        seconds: n as f64 / rps,
        avg_ms: num(2),
        p50_ms: num(4),
        p99_ms: num(6),
        total_ops: n,
        quiet_wait_s,
        note: Some(format!(
            "{n} requests, {threads} client thread(s), {errors}"
        )),
        ..Sample::default()
    };
    sample.cpu(cpu_before, cpu_after, n, true);
    redis_per_op(&mut sample, usec_before, usec_after, n);
    Ok(sample)
}

/// Runs `work` like [`measure`], and also reads Redis's command time per operation.
async fn measure_redis<W: Workload>(env: &Env, work: W) -> Result<Sample> {
    let mut conn = redis_conn(&env.redis_url).await?;
    let before = redis_usec(&mut conn).await;
    let mut sample = measure(&env.cfg, env.cfg.tasks, Metric::Applied, work).await?;
    let after = redis_usec(&mut conn).await;
    let ops = sample.total_ops;
    redis_per_op(&mut sample, before, after, ops);
    Ok(sample)
}

async fn section_acquire(env: &Env, round: usize, out: &mut Results) -> Result<()> {
    let cfg = &env.cfg;
    let issuer = Issuer::connect(&env.redis_url).await?;

    let work = AcquireFresh {
        issuer: issuer.clone(),
        prefix: prefix(env, "fresh"),
    };
    let sample = measure_redis(env, work).await?;
    put(out, round, "acquire.issuer_fresh", sample);

    let sample = redis_benchmark_row(env, 1).await?;
    put(out, round, "acquire.redis_benchmark", sample);
    let threads = cfg.workers.max(2);
    let sample = redis_benchmark_row(env, threads).await?;
    put(out, round, "acquire.redis_benchmark_mt", sample);

    let work = IssuerCycle {
        issuer: issuer.clone(),
        prefix: prefix(env, "cycle"),
    };
    let sample = measure_redis(env, work).await?;
    put(out, round, "acquire.issuer_cycle", sample);

    // The issuer on one multiplexed connection (what `Issuer::connect` opened before it
    // opened one per CPU).
    let client = redis::Client::open(env.redis_url.as_str())?;
    let work = IssuerCycle {
        issuer: Issuer::new(ConnectionManager::new(client).await?),
        prefix: prefix(env, "cycle-single"),
    };
    let sample = measure_redis(env, work).await?;
    put(out, round, "acquire.issuer_cycle_single", sample);

    let work = RslockCycle {
        manager: rslock::LockManager::new(vec![env.redis_url.clone()]),
        prefix: prefix(env, "rslock"),
    };
    let sample = measure_redis(env, work).await?;
    put(out, round, "acquire.rslock_cycle", sample);

    let client = redis::Client::open(env.redis_url.as_str())?;
    let work = HandRolledCycle {
        conn: ConnectionManager::new(client).await?,
        prefix: prefix(env, "setnx"),
    };
    let sample = measure_redis(env, work).await?;
    put(out, round, "acquire.handrolled_cycle", sample);
    Ok(())
}

async fn section_job(env: &Env, round: usize, out: &mut Results) -> Result<()> {
    let cfg = &env.cfg;
    let pool = tuned_pool(env, cfg.pool).await?;
    prep(env).await?;
    let work = JobCycle {
        issuer: Issuer::connect(&env.redis_url).await?,
        repo: Repository::new(pool.clone())?,
        pool: pool.clone(),
        // The same resources every round: their counters keep rising with the rows' fences.
        prefix: format!("{}:job", env.run_id),
        tasks: cfg.tasks,
        rows: cfg.rows,
    };
    let sample = measure_redis(env, work).await?;
    put(out, round, "job.cycle", sample);
    pool.close().await;
    Ok(())
}

/// Outcome of one audit check: rejections counted by the clients vs rows added to the audit.
#[derive(Clone, Debug, serde::Serialize)]
struct AuditCheck {
    what: String,
    rejections: u64,
    audit_rows: i64,
    pass: bool,
}

async fn section_storm(
    env: &Env,
    round: usize,
    out: &mut Results,
    checks: &mut Vec<AuditCheck>,
) -> Result<()> {
    let cfg = &env.cfg;
    let pool = tuned_pool(env, cfg.pool).await?;
    let repo = Repository::<GuardedRow>::new(pool.clone())?;
    let context = Some(Resource::new(format!("{}:storm", env.run_id))?);
    let work = |stale_every| RepoWrite {
        pool: pool.clone(),
        repo: repo.clone(),
        tasks: cfg.tasks,
        rows: cfg.rows,
        stale_every,
        context: context.clone(),
    };

    // Every row's fence above every token so far: token 1 is stale for every row.
    resync_tokens(env).await?;
    let high = TOKENS.load(Ordering::SeqCst) + 1;
    sqlx::query("UPDATE bench_guarded SET fence = $1")
        .bind(high)
        .execute(&env.admin)
        .await?;
    TOKENS.fetch_max(high, Ordering::SeqCst);

    for (key, stale_every, metric) in [
        ("storm.rejections", 1, Metric::Rejected),
        ("storm.all_fresh", 0, Metric::Applied),
        ("storm.mixed", 10, Metric::Applied),
    ] {
        prep(env).await?;
        let before = audit_rows(env).await?;
        let sample = measure(cfg, cfg.tasks, metric, work(stale_every)).await?;
        let added = audit_rows(env).await? - before;
        checks.push(AuditCheck {
            what: format!("round {round} {key}"),
            rejections: sample.rejected_total,
            audit_rows: added,
            pass: i64::try_from(sample.rejected_total).ok() == Some(added),
        });
        put(out, round, key, sample);
    }
    pool.close().await;
    Ok(())
}

async fn section_scaling(env: &Env, round: usize, out: &mut Results) -> Result<()> {
    let cfg = &env.cfg;
    for &tasks in &cfg.scaling {
        let pool = tuned_pool(env, u32::try_from(tasks.min(64))?).await?;
        prep(env).await?;
        let work = RepoWrite {
            repo: Repository::new(pool.clone())?,
            pool: pool.clone(),
            tasks,
            rows: cfg.rows,
            stale_every: 0,
            context: None,
        };
        let sample = measure(cfg, tasks, Metric::Applied, work).await?;
        put(out, round, &format!("scaling.c{tasks}"), sample);
        pool.close().await;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Report

/// The rows of the table, in order: key and label.
fn rows(cfg: &Config) -> Vec<(String, String)> {
    let mut rows: Vec<(String, String)> = [
        ("write.repo_update", "1a Repository::update (guarded table)"),
        (
            "write.plain_update",
            "1b sqlx plain UPDATE (unguarded table)",
        ),
        ("write.raw_repo_sql", "1c sqlx, the repository's exact SQL"),
        (
            "write.fenced_plain_sql",
            "1d sqlx UPDATE .. AND fence < $3 (hand-written)",
        ),
        (
            "write.repo_update_default_pool",
            "1e 1a with sqlx default PoolOptions",
        ),
        (
            "pgbench.plain_update",
            "2b pgbench: plain UPDATE (unguarded)",
        ),
        (
            "pgbench.fenced_plain_sql",
            "2d pgbench: UPDATE .. AND fence < tok",
        ),
        ("pgbench.repo_sql", "2c pgbench: the repository's SQL"),
        (
            "acquire.issuer_fresh",
            "3a Issuer::acquire (fresh resource)",
        ),
        (
            "acquire.redis_benchmark",
            "3b redis-benchmark EVALSHA acquire.lua",
        ),
        (
            "acquire.redis_benchmark_mt",
            "3b' the same, --threads = workers",
        ),
        ("acquire.issuer_cycle", "3c Issuer acquire+release"),
        (
            "acquire.issuer_cycle_single",
            "3c' 3c, issuer on one multiplexed connection",
        ),
        ("acquire.rslock_cycle", "3d rslock lock+unlock"),
        ("acquire.handrolled_cycle", "3e SET NX PX + Lua compare-DEL"),
        ("job.cycle", "4  acquire -> fenced write -> release"),
        ("storm.rejections", "5a stale writes, rejected + audited"),
        ("storm.all_fresh", "5b fenced writes, all fresh"),
        ("storm.mixed", "5c accepted writes, 10% stale mix"),
    ]
    .iter()
    .map(|(k, l)| ((*k).to_owned(), (*l).to_owned()))
    .collect();
    for c in &cfg.scaling {
        rows.push((
            format!("scaling.c{c}"),
            format!("6  Repository::update, {c} task(s), pool {}", (*c).min(64)),
        ));
    }
    rows
}

/// A ratio between two rows; `target` when the project has one.
struct RatioDef {
    key: &'static str,
    label: &'static str,
    num: &'static str,
    /// The best of these is the denominator.
    den: &'static [&'static str],
    target: Option<f64>,
}

const RATIOS: &[RatioDef] = &[
    RatioDef {
        key: "repo_vs_raw_sql",
        label: "Repository::update / raw sqlx, identical SQL (1a/1c)",
        num: "write.repo_update",
        den: &["write.raw_repo_sql"],
        target: Some(0.95),
    },
    RatioDef {
        key: "guarded_vs_plain",
        label: "fenced+guarded / plain unguarded update (1a/1b)",
        num: "write.repo_update",
        den: &["write.plain_update"],
        target: Some(0.85),
    },
    RatioDef {
        key: "repo_vs_pgbench",
        label: "Repository::update / pgbench, same SQL (1a/2c)",
        num: "write.repo_update",
        den: &["pgbench.repo_sql"],
        target: Some(0.80),
    },
    RatioDef {
        key: "acquire_vs_redis_benchmark",
        label: "Issuer::acquire / best redis-benchmark EVALSHA (3a/3b)",
        num: "acquire.issuer_fresh",
        den: &["acquire.redis_benchmark", "acquire.redis_benchmark_mt"],
        target: Some(0.80),
    },
    RatioDef {
        key: "cycle_vs_rslock",
        label: "Issuer acquire+release / rslock lock+unlock (3c/3d)",
        num: "acquire.issuer_cycle",
        den: &["acquire.rslock_cycle"],
        target: Some(1.0),
    },
    RatioDef {
        key: "mixed_vs_fresh",
        label: "accepted writes, 10% stale / all fresh (5c/5b)",
        num: "storm.mixed",
        den: &["storm.all_fresh"],
        target: Some(0.90),
    },
    RatioDef {
        key: "fence_sql_vs_plain",
        label: "fence + guard, SQL only (1d/1b)",
        num: "write.fenced_plain_sql",
        den: &["write.plain_update"],
        target: None,
    },
    RatioDef {
        key: "classification",
        label: "repository SQL / hand-written fenced UPDATE (1c/1d)",
        num: "write.raw_repo_sql",
        den: &["write.fenced_plain_sql"],
        target: None,
    },
    RatioDef {
        key: "sqlx_vs_pgbench_plain",
        label: "sqlx / pgbench, plain UPDATE (1b/2b)",
        num: "write.plain_update",
        den: &["pgbench.plain_update"],
        target: None,
    },
    RatioDef {
        key: "sqlx_vs_pgbench_fenced",
        label: "sqlx / pgbench, UPDATE .. fence < tok (1d/2d)",
        num: "write.fenced_plain_sql",
        den: &["pgbench.fenced_plain_sql"],
        target: None,
    },
    RatioDef {
        key: "default_pool_vs_tuned",
        label: "sqlx default pool / tuned pool (1e/1a)",
        num: "write.repo_update_default_pool",
        den: &["write.repo_update"],
        target: None,
    },
    RatioDef {
        key: "cycle_single_vs_rslock",
        label: "Issuer acquire+release, one connection / rslock (3c'/3d)",
        num: "acquire.issuer_cycle_single",
        den: &["acquire.rslock_cycle"],
        target: None,
    },
    RatioDef {
        key: "cycle_vs_handrolled",
        label: "Issuer acquire+release / SET NX + compare-DEL (3c/3e)",
        num: "acquire.issuer_cycle",
        den: &["acquire.handrolled_cycle"],
        target: None,
    },
    RatioDef {
        key: "job_vs_write",
        label: "job cycle / Repository::update (4/1a)",
        num: "job.cycle",
        den: &["write.repo_update"],
        target: None,
    },
];

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

/// Prints the tables and builds the JSON document.
fn report(env: &Env, rounds: &[Results], checks: &[AuditCheck], info: &Json) -> Json {
    let cfg = &env.cfg;
    let mut medians = serde_json::Map::new();
    println!();
    println!(
        "pgfence throughput — {} task(s), pool {}, {} rows, {} s measured after {} s warm-up, \
         {} round(s); medians",
        cfg.tasks, cfg.pool, cfg.rows, cfg.secs, cfg.warmup, cfg.rounds
    );
    println!();
    println!(
        "{:<46} {:>9} {:>7} {:>7} {:>6} {:>6} {:>6} {:>6} {:>6} {:>5}  {:<23} notes",
        "measurement",
        "ops/s",
        "p50 ms",
        "p99 ms",
        "cli us",
        "pg us",
        "rds us",
        "oth us",
        "all us",
        "cpus",
        "per round"
    );
    for (key, label) in rows(cfg) {
        let samples: Vec<&Sample> = rounds.iter().filter_map(|r| r.get(&key)).collect();
        if samples.is_empty() {
            continue;
        }
        let med =
            |f: fn(&Sample) -> Option<f64>| median(samples.iter().filter_map(|s| f(s)).collect());
        let ops = med(|s| s.ops_per_sec);
        let p50 = med(|s| s.p50_ms);
        let p99 = med(|s| s.p99_ms);
        let client = med(|s| s.client_cpu_us_per_op);
        let pg = med(|s| s.pg_server_us_per_op);
        let redis = med(|s| s.redis_server_us_per_op);
        let machine = med(|s| s.machine_cpu_us_per_op);
        let other = med(Sample::other_cpu_us_per_op);
        let busy = med(|s| s.busy_cpus);
        let per_round: Vec<String> = samples.iter().map(|s| fmt_opt(s.ops_per_sec, 0)).collect();
        let bad: u64 = samples.iter().map(|s| s.failed).sum();
        let mut notes = Vec::new();
        if bad > 0 {
            notes.push(format!("{bad} failed"));
        }
        if let Some(n) = samples.last().and_then(|s| s.note.clone()) {
            notes.push(n);
        }
        println!(
            "{label:<46} {:>9} {:>7} {:>7} {:>6} {:>6} {:>6} {:>6} {:>6} {:>5}  {:<23} {}",
            fmt_opt(ops, 0),
            fmt_opt(p50, 2),
            fmt_opt(p99, 2),
            fmt_opt(client, 0),
            fmt_opt(pg, 0),
            fmt_opt(redis, 0),
            fmt_opt(other, 0),
            fmt_opt(machine, 0),
            fmt_opt(busy, 2),
            per_round.join(" / "),
            notes.join("; ")
        );
        medians.insert(
            key,
            json!({
                "ops_per_sec": ops, "p50_ms": p50, "p99_ms": p99,
                "client_cpu_us_per_op": client, "machine_cpu_us_per_op": machine,
                "pg_server_cpu_us_per_op": pg, "other_cpu_us_per_op": other,
                "redis_server_us_per_op": redis, "busy_cpus": busy,
            }),
        );
    }

    println!(
        "CPU microseconds per operation — cli: the client (this process or the tool); pg: the \
         PostgreSQL server; rds: the Redis server (warm-up included); oth: everything else on the \
         machine (other work skews a row: check it); all: the whole machine; \
         cpus: busy CPUs in the window (of {})",
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    println!();
    println!(
        "{:<58} {:>7} {:>7}  {:<8} per round",
        "ratio (median of per-round ratios)", "value", "target", "result"
    );
    let mut ratios = serde_json::Map::new();
    for def in RATIOS {
        let per_round: Vec<f64> = rounds
            .iter()
            .filter_map(|r| {
                let n = r.get(def.num)?.ops_per_sec?;
                let d = def
                    .den
                    .iter()
                    .filter_map(|k| r.get(*k)?.ops_per_sec)
                    .reduce(f64::max)?;
                (d > 0.0).then_some(n / d)
            })
            .collect();
        let value = median(per_round.clone());
        let result = match (value, def.target) {
            (None, _) => "n/a",
            (Some(_), None) => "info",
            (Some(v), Some(t)) if v >= t => "MET",
            (Some(_), Some(_)) => "MISSED",
        };
        println!(
            "{:<58} {:>7} {:>7}  {result:<8} {}",
            def.label,
            fmt_opt(value, 3),
            fmt_opt(def.target, 2),
            per_round
                .iter()
                .map(|v| format!("{v:.3}"))
                .collect::<Vec<_>>()
                .join(" / ")
        );
        ratios.insert(
            def.key.to_owned(),
            json!({
                "label": def.label, "numerator": def.num, "denominator": def.den,
                "value": value, "per_round": per_round, "target": def.target, "result": result,
            }),
        );
    }

    if !checks.is_empty() {
        println!();
        for c in checks {
            println!(
                "audit check {:<32} {} rejections, {} audit rows: {}",
                c.what,
                c.rejections,
                c.audit_rows,
                if c.pass { "PASS" } else { "FAIL" }
            );
        }
    }
    let matches = env.repo_sql == REPO_UPDATE_SQL;
    println!();
    println!(
        "repository SQL (read back from pg_prepared_statements; {} the copy in this bench):\n  {}",
        if matches { "matches" } else { "DIFFERS FROM" },
        env.repo_sql
    );

    json!({
        "config": cfg,
        "environment": info,
        "repository_sql": env.repo_sql,
        "repository_sql_matches_bench_copy": matches,
        "medians": medians,
        "ratios": ratios,
        "audit_checks": checks,
        "rounds": rounds,
    })
}

/// Facts about the machine and the servers, for the report.
async fn environment(env: &Env, pg_source: &str, redis_source: &str) -> Json {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:").map(|m| m.trim().to_owned()));
    let pg_version: Option<String> = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&env.admin)
        .await
        .ok();
    let redis_version = match redis_conn(&env.redis_url).await {
        Ok(mut c) => redis::cmd("INFO")
            .arg("server")
            .query_async::<String>(&mut c)
            .await
            .ok()
            .and_then(|i| {
                i.lines()
                    .find_map(|l| l.strip_prefix("redis_version:").map(str::to_owned))
            }),
        Err(_) => None,
    };
    let version = |bin: &Option<PathBuf>| {
        bin.as_ref().and_then(|b| {
            let out = std::process::Command::new(b)
                .arg("--version")
                .output()
                .ok()?;
            Some(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        })
    };
    json!({
        "cpus": std::thread::available_parallelism().map_or(0, usize::from),
        "cpu_model": cpu,
        "memory": mem,
        "postgres": pg_version,
        "postgres_server": pg_source,
        "redis": redis_version,
        "redis_server": redis_source,
        "pgbench": version(&env.pgbench),
        "redis_benchmark": version(&env.redis_benchmark),
    })
}

// ---------------------------------------------------------------------------------------------
// Main

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") {
        println!(
            "throughput: benchmark, not run under `cargo test`; use `cargo bench --bench throughput`"
        );
        return Ok(());
    }
    let cfg = Config::from_env(&args)?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.workers)
        .enable_all()
        .build()?
        .block_on(run(cfg))
}

async fn run(cfg: Config) -> Result<()> {
    let (pg_url, pg_server, pg_source) = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => (url, None, "DATABASE_URL"),
        _ => {
            eprintln!("starting a throwaway PostgreSQL (set DATABASE_URL to use a running one)");
            let server = Server::postgres().await?;
            (
                server.url(),
                Some(server),
                "throwaway (fsync=off, synchronous_commit=off)",
            )
        }
    };
    let (redis_url, redis_server, redis_source) = match std::env::var("REDIS_URL") {
        Ok(url) if !url.is_empty() => (url, None, "REDIS_URL"),
        _ => {
            eprintln!("starting a throwaway Redis (set REDIS_URL to use a running one)");
            let server = Server::redis().await?;
            (server.url(), Some(server), "throwaway (no persistence)")
        }
    };

    let run_id = format!("pgfbench-{:08x}", rand::random::<u32>());
    let db_name = format!(
        "pgfence_bench_{}_{}",
        std::process::id(),
        rand::random::<u32>()
    );
    let maintenance = PgConnectOptions::from_str(&pg_url)?;
    let mut conn = PgConnection::connect_with(&maintenance).await?;
    run_sql_conn(&mut conn, &format!("CREATE DATABASE \"{db_name}\"")).await?;
    conn.close().await?;

    let scratch = std::env::temp_dir().join(&run_id);
    std::fs::create_dir_all(&scratch)?;
    let result = bench(
        cfg,
        &maintenance,
        &pg_url,
        &db_name,
        redis_url.clone(),
        run_id.clone(),
        scratch.clone(),
        (pg_source, redis_source),
    )
    .await;

    // Clean up whatever happened: the database, the scripts, and this run's keys in a Redis
    // we did not start.
    let _ = std::fs::remove_dir_all(&scratch);
    if let Ok(mut conn) = PgConnection::connect_with(&maintenance).await {
        let _ = run_sql_conn(
            &mut conn,
            &format!("DROP DATABASE IF EXISTS \"{db_name}\" WITH (FORCE)"),
        )
        .await;
        let _ = conn.close().await;
    }
    if redis_server.is_none()
        && let Err(e) = delete_keys(&redis_url, &run_id).await
    {
        eprintln!("could not delete this run's Redis keys ({run_id}*): {e}");
    }
    drop(redis_server);
    drop(pg_server);
    result
}

async fn run_sql_conn(conn: &mut PgConnection, sql: &str) -> Result<()> {
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .execute(&mut *conn)
        .await
        .with_context(|| format!("running {sql}"))?;
    Ok(())
}

/// Finds the server's postmaster among this machine's processes (the parent of our backend),
/// for the PostgreSQL CPU figures; leaves [`POSTMASTER`] unset for a remote server.
async fn find_postmaster(admin: &PgPool) {
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

/// Deletes every key containing `run_id` (SCAN + UNLINK).
async fn delete_keys(url: &str, run_id: &str) -> Result<()> {
    let mut conn = redis_conn(url).await?;
    let pattern = format!("*{run_id}*");
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            redis::cmd("UNLINK")
                .arg(&keys)
                .query_async::<i64>(&mut conn)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

#[allow(clippy::too_many_arguments)]
async fn bench(
    cfg: Config,
    maintenance: &PgConnectOptions,
    pg_url: &str,
    db_name: &str,
    redis_url: String,
    run_id: String,
    scratch: PathBuf,
    (pg_source, redis_source): (&str, &str),
) -> Result<()> {
    let db = maintenance.clone().database(db_name);
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(db.clone())
        .await?;
    pgfence::migrate(&admin).await?;
    find_postmaster(&admin).await;
    create_tables(&admin, cfg.rows).await?;
    let repo_sql = capture_repo_sql(&db).await?;
    let mut pg_dirs = postgres_bindirs();
    pg_dirs.extend(["/usr/bin", "/usr/local/bin"].map(PathBuf::from));
    let env = Env {
        db,
        db_url: with_database(pg_url, db_name)?,
        admin,
        redis_url,
        run_id,
        repo_sql,
        pgbench: find_tool("pgbench", &pg_dirs),
        redis_benchmark: find_tool(
            "redis-benchmark",
            &["/usr/bin", "/usr/local/bin"].map(PathBuf::from),
        ),
        scratch,
        cfg,
    };
    let info = environment(&env, pg_source, redis_source).await;
    eprintln!("{info}");

    let mut rounds = Vec::new();
    let mut checks = Vec::new();
    if ["write", "pgbench", "job", "storm", "scaling"]
        .iter()
        .any(|s| env.cfg.runs(s))
    {
        condition(&env).await?;
    }
    let mut loads = Vec::new();
    for round in 1..=env.cfg.rounds {
        let mut out = Results::new();
        // Other work on the machine skews everything: record the load each round starts with.
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        eprintln!("round {round}: load average {}", load.trim());
        loads.push(load.trim().to_owned());
        if env.cfg.runs("write") {
            section_write(&env, round, &mut out).await?;
        }
        if env.cfg.runs("pgbench") {
            section_pgbench(&env, round, &mut out).await?;
        }
        if env.cfg.runs("acquire") {
            section_acquire(&env, round, &mut out).await?;
        }
        if env.cfg.runs("job") {
            section_job(&env, round, &mut out).await?;
        }
        if env.cfg.runs("storm") {
            section_storm(&env, round, &mut out, &mut checks).await?;
        }
        if env.cfg.runs("scaling") {
            section_scaling(&env, round, &mut out).await?;
        }
        rounds.push(out);
    }

    let mut doc = report(&env, &rounds, &checks, &info);
    println!(
        "load average at the start of each round: {}",
        loads.join(" | ")
    );
    doc["load_average_at_round_start"] = json!(loads);
    if let Some(dir) = env.cfg.json.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&env.cfg.json, serde_json::to_string_pretty(&doc)?)?;
    println!();
    println!("figures written to {}", env.cfg.json.display());
    env.admin.close().await;
    if checks.iter().any(|c| !c.pass) {
        bail!("an audit check failed");
    }
    Ok(())
}
