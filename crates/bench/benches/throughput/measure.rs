//! The measuring loop: a [`Workload`] run by many tasks, warm-up then a measured window, and
//! what one figure records ([`Sample`]); tokens and keys.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use pgfence::{FenceToken, Fencing};
use pgfence_bench::SplitMix64;

use crate::config::Config;
use crate::cpu::{cpu_snap, quiet_gate};

/// The last token handed out; every fresh write takes the next one. Tokens, not fences: a
/// fence stored by a write packs the token with more (see [`lease_fence`]).
pub(crate) static TOKENS: AtomicI64 = AtomicI64::new(0);

/// Makes resource names unique across measurements (and rounds).
pub(crate) static NONCE: AtomicU64 = AtomicU64::new(0);

/// A token newer than every one handed out so far.
pub(crate) fn next_token() -> FenceToken {
    FenceToken::new(TOKENS.fetch_add(1, Ordering::Relaxed) + 1).expect("tokens start at 1")
}

/// The fence a write with the bare token `token` stores in a row it had not written
/// ([`Fencing::lease_fence`]), and the value the repository's SQL binds for it.
pub(crate) fn lease_fence(token: i64) -> i64 {
    Fencing::from(FenceToken::new(token).expect("a token")).lease_fence()
}

/// Token 1, which every row's fence has passed once the row has been written.
pub(crate) fn stale_token() -> FenceToken {
    FenceToken::new(1).expect("1 is a token")
}

/// What one operation came to.
pub(crate) enum Outcome {
    /// Done as intended (write applied, lock taken...).
    Applied,
    /// Refused as designed: a stale token, or a lock held by someone else.
    Rejected,
    /// Anything else.
    Failed(String),
}

impl<T> From<Result<T, pgfence::Error>> for Outcome {
    fn from(r: Result<T, pgfence::Error>) -> Self {
        match r {
            Ok(_) => Outcome::Applied,
            Err(e) if e.is_stale() => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// A load: per-task state and one operation, repeated by every task until time is up.
pub(crate) trait Workload: Send + Sync + 'static {
    /// Per-task state (key generator, row buffer...).
    type State: Send + 'static;
    /// The state of task `task`.
    fn state(&self, task: usize) -> Self::State;
    /// One operation.
    fn op(&self, state: &mut Self::State) -> impl Future<Output = Outcome> + Send;
}

/// Which count a measurement reports as its throughput.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Metric {
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
pub(crate) struct Sample {
    /// The headline rate (operations per second), `None` when the row was skipped.
    pub(crate) ops_per_sec: Option<f64>,
    /// Measured window in seconds.
    pub(crate) seconds: f64,
    /// Applied / rejected / failed operations in the window.
    pub(crate) applied: u64,
    pub(crate) rejected: u64,
    pub(crate) failed: u64,
    /// Rejections over the whole measurement, warm-up included.
    pub(crate) rejected_total: u64,
    pub(crate) p50_ms: Option<f64>,
    pub(crate) p99_ms: Option<f64>,
    /// Set by the external tools (pgbench's latency average, redis-benchmark's).
    pub(crate) avg_ms: Option<f64>,
    /// Operations over the whole measurement, warm-up included.
    pub(crate) total_ops: u64,
    /// CPU time of the client (this process, or the external tool) per operation, in the
    /// measured window.
    pub(crate) client_cpu_us_per_op: Option<f64>,
    /// CPU time of the whole machine (client, servers, anything else running) per operation.
    pub(crate) machine_cpu_us_per_op: Option<f64>,
    /// Average busy CPUs over the window (of `available_parallelism`).
    pub(crate) busy_cpus: Option<f64>,
    /// Seconds spent waiting for the machine to go quiet before starting.
    pub(crate) quiet_wait_s: f64,
    /// CPU time of the PostgreSQL server per operation (local servers only).
    pub(crate) pg_server_us_per_op: Option<f64>,
    /// CPU time of the Redis server per operation (`INFO cpu`), for Redis rows.
    pub(crate) redis_server_us_per_op: Option<f64>,
    /// CPU time of the etcd server per operation (local throwaway server only; warm-up
    /// included), for the etcd rows.
    pub(crate) etcd_server_us_per_op: Option<f64>,
    /// CPU time of the ZooKeeper server (its JVM) per operation (local throwaway server only;
    /// warm-up included), for the ZooKeeper rows.
    pub(crate) zk_server_us_per_op: Option<f64>,
    /// WAL the PostgreSQL server wrote per operation, in bytes (`pg_current_wal_lsn()` before
    /// and after; warm-up included), for the rows of section `pg`.
    pub(crate) pg_wal_bytes_per_op: Option<f64>,
    /// Sequential scans of the section's tables the PostgreSQL server started per operation
    /// (`pg_stat_user_tables.seq_scan`, warm-up included), for the PostgreSQL rows of section
    /// `pg`: 0 when every lookup used an index.
    pub(crate) pg_seq_scans_per_op: Option<f64>,
    /// Buffer accesses (heap and index blocks, hit or read, `pg_statio_user_tables`) of the
    /// section's tables per operation, warm-up included, for the same rows.
    pub(crate) pg_blocks_per_op: Option<f64>,
    pub(crate) note: Option<String>,
    /// What went wrong in a figure that still produced a rate (an external tool's failed
    /// transactions or error replies, writes that did not update their rows): the run fails
    /// at the end (see `report::problems`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) problem: Option<String>,
    /// Rows one operation writes (a batch row: its size). The rate and the CPU figures are
    /// then per row; the latencies stay per operation (per batch).
    pub(crate) rows_per_op: Option<u64>,
}

impl Sample {
    /// A row that was not measured, and why.
    pub(crate) fn skipped(note: impl Into<String>) -> Self {
        Self {
            note: Some(note.into()),
            ..Self::default()
        }
    }
}

impl Sample {
    /// Turns a figure of operations that each wrote `rows` rows into one per row: the rate
    /// is multiplied by `rows`, the CPU per operation divided by it.
    pub(crate) fn per_row(&mut self, rows: u64) {
        let n = rows as f64;
        self.ops_per_sec = self.ops_per_sec.map(|r| r * n);
        for v in [
            &mut self.client_cpu_us_per_op,
            &mut self.machine_cpu_us_per_op,
            &mut self.pg_server_us_per_op,
            &mut self.redis_server_us_per_op,
            &mut self.etcd_server_us_per_op,
            &mut self.zk_server_us_per_op,
        ] {
            *v = v.map(|c| c / n);
        }
        self.rows_per_op = Some(rows);
    }
}

/// Shared start/stop flags of one measurement.
#[derive(Default)]
struct Gate {
    measuring: AtomicBool,
    stop: AtomicBool,
}

/// Runs `work` on `tasks` tokio tasks: `cfg.warmup` seconds unmeasured, then `cfg.secs`
/// measured.
pub(crate) async fn measure<W: Workload>(
    cfg: &Config,
    tasks: usize,
    metric: Metric,
    work: W,
) -> Result<Sample> {
    let quiet_wait_s = quiet_gate(cfg.quiet_wait).await;
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

/// Uniform random ids of the rows task `task` owns: `1 + task + tasks * k` for `k` in
/// `0..rows / tasks` — the same set the pgbench scripts draw from for client `task`.
pub(crate) struct Keys {
    rng: SplitMix64,
    base: i64,
    stride: i64,
    slots: u64,
}

impl Keys {
    pub(crate) fn new(task: usize, tasks: usize, rows: i32) -> Self {
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

    pub(crate) fn next(&mut self) -> i32 {
        let k = i64::try_from(self.rng.below(self.slots)).expect("slots fit i64");
        i32::try_from(self.base + self.stride * k).expect("ids fit i32")
    }
}

/// Keys of one task's batches: each batch is `size` distinct ids of the task's rows (the ids
/// [`Keys`] draws from), from a random start slot spread by [`pgfence_bench::spread_step`] —
/// the same ids the pgbench ceiling computes for its client.
pub(crate) struct BatchKeys {
    rng: SplitMix64,
    base: i64,
    stride: i64,
    slots: u64,
    step: u64,
    size: u64,
}

impl BatchKeys {
    pub(crate) fn new(task: usize, tasks: usize, rows: i32, size: usize) -> Self {
        let keys = Keys::new(task, tasks, rows);
        assert!(
            u64::try_from(size).is_ok_and(|s| s <= keys.slots),
            "a batch cannot be larger than a task's rows"
        );
        Self {
            step: pgfence_bench::spread_step(keys.slots),
            size: u64::try_from(size).expect("checked above"),
            rng: keys.rng,
            base: keys.base,
            stride: keys.stride,
            slots: keys.slots,
        }
    }

    /// Writes the next batch's ids into `ids` (cleared first).
    pub(crate) fn next(&mut self, ids: &mut Vec<i32>) {
        ids.clear();
        let start = self.rng.below(self.slots);
        ids.extend((0..self.size).map(|j| {
            let slot = pgfence_bench::spread_slot(start, j, self.step, self.slots);
            let slot = i64::try_from(slot).expect("slots fit i64");
            i32::try_from(self.base + self.stride * slot).expect("ids fit i32")
        }));
    }
}
