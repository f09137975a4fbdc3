//! The zombie scenario, with real processes: worker A takes the task and is stopped
//! (`SIGSTOP`) right before its provider call, past its missed heartbeats; apalis-postgres
//! re-enqueues the task and worker B runs it to the end; then A is resumed (`SIGCONT`) and
//! finishes its run. Used by `main.rs` (the example) and by the tests, which assert on the
//! [`Report`].
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, TryRecvError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use apalis_core::backend::TaskSink;
use apalis_core::error::BoxDynError;
use pgfence_testkit::{Provider, signal_pid};
use sqlx::PgPool;

use crate::worker::{self, AMOUNT, ChargeInvoice, FENCED, Invoice, UNFENCED};

/// How long any one step may take before the scenario gives up.
const STEP: Duration = Duration::from_secs(30);

/// The task's row in `apalis.jobs`.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct Job {
    /// `Done`, `Failed`, `Running`...
    pub status: String,
    /// The worker that holds (or last held) the task.
    pub lock_by: Option<String>,
    /// apalis's attempt count.
    pub attempts: i32,
    /// The result apalis recorded.
    pub last_result: Option<serde_json::Value>,
    /// When it was recorded.
    pub done_at: Option<String>,
}

/// A rejection in `pgfence.audit`.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct Audited {
    /// `update`, `check`, `effect`...
    pub operation: String,
    /// The table, for a row write.
    pub table_name: Option<String>,
    /// The zombie's token.
    pub presented: i64,
    /// The newer token it met.
    pub current: Option<i64>,
}

/// What happened.
#[derive(Debug)]
pub struct Report {
    /// Whether the workers ran the fenced handler.
    pub fenced: bool,
    /// The task's id.
    pub task_id: String,
    /// Worker A (the zombie) and worker B (the live run).
    pub zombie: String,
    /// Worker B's name.
    pub live: String,
    /// How long A was stopped.
    pub stopped_for: Duration,
    /// The task's row when B had finished, and at the end.
    pub job_after_live: Job,
    /// The task's row at the end.
    pub job_final: Job,
    /// The invoice at the end.
    pub invoice: Invoice,
    /// Charges the provider made for the invoice; answers it replayed; calls it refused as in
    /// flight.
    pub charges: u64,
    /// Replayed answers.
    pub replays: u64,
    /// Concurrent duplicates refused.
    pub conflicts: u64,
    /// The rejections audited for the task's resource.
    pub audit: Vec<Audited>,
    /// A's and B's `OUTCOME` lines.
    pub zombie_outcome: String,
    /// B's `OUTCOME` line.
    pub live_outcome: String,
    /// A's stderr (its log events).
    pub zombie_log: String,
    /// How long the whole scenario took.
    pub took: Duration,
}

/// How to start a worker process: the program and the arguments before the worker's own.
pub struct WorkerCommand {
    /// The program.
    pub program: PathBuf,
    /// Arguments before the worker's own (`["worker"]` for the example itself).
    pub args: Vec<String>,
}

/// Runs the scenario on `pool` (whose URL `db_url` the workers get). `narrate` gets one line
/// per step.
pub async fn run(
    pool: &PgPool,
    db_url: &str,
    command: &WorkerCommand,
    fenced: bool,
    narrate: &dyn Fn(&str),
) -> Result<Report, BoxDynError> {
    let began = Instant::now();
    worker::setup(pool).await?;
    let provider = Provider::start(Duration::from_millis(20))?;
    let invoice = i64::from(rand::random::<u32>());
    let table = if fenced { FENCED } else { UNFENCED };
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (id, amount, status) VALUES ($1, $2, 'open')"
    )))
    .bind(invoice)
    .bind(AMOUNT)
    .execute(pool)
    .await?;
    let queue = format!("pgfence-apalis-zombie-{invoice}");
    worker::storage(pool, &queue)
        .push(ChargeInvoice { invoice })
        .await?;
    let task_id: String = sqlx::query_scalar("SELECT id FROM apalis.jobs WHERE job_type = $1")
        .bind(&queue)
        .fetch_one(pool)
        .await?;
    let mode = if fenced { "fenced" } else { "plain" };
    narrate(&format!(
        "task {task_id}: charge invoice {invoice} ({mode} handler)"
    ));

    let (zombie, live) = (format!("worker-a-{invoice}"), format!("worker-b-{invoice}"));
    let spawn = |name: &str| {
        Process::spawn(
            name,
            &command.program,
            command
                .args
                .iter()
                .cloned()
                .chain([
                    db_url.to_owned(),
                    provider.url(),
                    queue.clone(),
                    name.to_owned(),
                    mode.to_owned(),
                ])
                .collect(),
        )
    };
    let mut a = spawn(&zombie)?;
    a.line("PAUSE").await?;
    // A waits at its pause point. Stop it once apalis has committed its lock on the task
    // (status Running): a worker stopped inside one of its own transactions holds the task's
    // row lock, and apalis-postgres's re-enqueue (`FOR UPDATE SKIP LOCKED`) then skips the
    // task for as long as that connection lives.
    running(pool, &task_id, &zombie).await?;
    signal_pid(a.pid(), "-STOP")?;
    let stopped = Instant::now();
    // The go-ahead waits in the pipe until A runs again.
    a.go()?;
    narrate(&format!(
        "A ({zombie}, pid {}) took the task; stopped (SIGSTOP) right before its provider call",
        a.pid()
    ));

    let mut b = spawn(&live)?;
    narrate(&format!(
        "B ({live}, pid {}) started; apalis re-enqueues the task once A has missed {} heartbeats of {:?}",
        b.pid(),
        worker::MISSED_HEARTBEATS,
        worker::HEARTBEAT
    ));
    b.line("PAUSE").await?;
    b.go()?;
    let live_outcome = b.line("OUTCOME").await?;
    b.exit().await?;
    let job_after_live = job(pool, &task_id).await?;
    narrate(&format!(
        "B finished: {live_outcome}; apalis.jobs: {} by {}",
        job_after_live.status,
        job_after_live.lock_by.as_deref().unwrap_or("-")
    ));

    signal_pid(a.pid(), "-CONT")?;
    let stopped_for = stopped.elapsed();
    narrate(&format!(
        "A resumed (SIGCONT) after {:.1}s, unaware, and finishes its run",
        stopped_for.as_secs_f64()
    ));
    let zombie_outcome = a.line("OUTCOME").await?;
    a.exit().await?;
    narrate(&format!("A finished: {zombie_outcome}"));

    let invoice: Invoice = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT * FROM {table} WHERE id = $1"
    )))
    .bind(invoice)
    .fetch_one(pool)
    .await?;
    let audit: Vec<Audited> = sqlx::query_as(
        "SELECT operation, table_name, presented, current FROM pgfence.audit
         WHERE resource = $1 ORDER BY id",
    )
    .bind(format!("apalis:task:{task_id}"))
    .fetch_all(pool)
    .await?;
    let (_, replays, conflicts) = provider.counts();
    Ok(Report {
        fenced,
        job_final: job(pool, &task_id).await?,
        job_after_live,
        charges: provider.charges(&format!("invoice-{}", invoice.id)),
        replays,
        conflicts,
        invoice,
        audit,
        zombie_log: a.stderr(),
        zombie_outcome,
        live_outcome,
        task_id,
        zombie,
        live,
        stopped_for,
        took: began.elapsed(),
    })
}

/// Removes what a run left in a shared database (the example's `DATABASE_URL`).
pub async fn clean_up(pool: &PgPool, report: &Report) -> Result<(), BoxDynError> {
    let resource = format!("apalis:task:{}", report.task_id);
    // The PostgreSQL issuer's counter and lock of the task's resource go too (the task is
    // gone; nothing will take that resource again).
    for sql in [
        "DELETE FROM pgfence.issuer_lock WHERE resource = $1",
        "DELETE FROM pgfence.issuer_counter WHERE counter = $1",
        "DELETE FROM pgfence.audit WHERE resource = $1",
        "DELETE FROM pgfence.effect WHERE scope = $1",
        "DELETE FROM pgfence.resource_fence WHERE resource = $1",
    ] {
        sqlx::query(sql).bind(&resource).execute(pool).await?;
    }
    sqlx::query("DELETE FROM apalis.jobs WHERE id = $1")
        .bind(&report.task_id)
        .execute(pool)
        .await?;
    sqlx::query("DELETE FROM apalis.workers WHERE id = $1 OR id = $2")
        .bind(&report.zombie)
        .bind(&report.live)
        .execute(pool)
        .await?;
    let table = if report.fenced { FENCED } else { UNFENCED };
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM {table} WHERE id = $1"
    )))
    .bind(report.invoice.id)
    .execute(pool)
    .await?;
    Ok(())
}

/// Waits until the task is `Running` under `worker`'s lock.
async fn running(pool: &PgPool, task_id: &str, worker: &str) -> Result<(), BoxDynError> {
    let deadline = Instant::now() + STEP;
    loop {
        let job = job(pool, task_id).await?;
        if job.status == "Running" && job.lock_by.as_deref() == Some(worker) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{worker} never locked the task: {job:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn job(pool: &PgPool, task_id: &str) -> Result<Job, BoxDynError> {
    Ok(sqlx::query_as(
        "SELECT status, lock_by, attempts, last_result, done_at::text AS done_at
         FROM apalis.jobs WHERE id = $1",
    )
    .bind(task_id)
    .fetch_one(pool)
    .await?)
}

/// A worker process started by the scenario; killed (by its PID) if still running when
/// dropped.
struct Process {
    name: String,
    child: Child,
    lines: Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Process {
    fn spawn(name: &str, program: &PathBuf, args: Vec<String>) -> Result<Self, BoxDynError> {
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("start {}: {e}", program.display()))?;
        let (tx, lines) = channel();
        let stdout = child.stdout.take().ok_or("no stdout")?;
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut pipe = child.stderr.take().ok_or("no stderr")?;
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                if let Ok(mut s) = sink.lock() {
                    s.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            }
        });
        Ok(Self {
            name: name.to_owned(),
            child,
            lines,
            stderr,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Lets the worker go on past its pause point.
    fn go(&mut self) -> Result<(), BoxDynError> {
        let stdin = self.child.stdin.as_mut().ok_or("no stdin")?;
        stdin.write_all(b"go\n")?;
        stdin.flush()?;
        Ok(())
    }

    fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// The next stdout line starting with `prefix` (earlier lines are skipped).
    async fn line(&mut self, prefix: &str) -> Result<String, BoxDynError> {
        let deadline = Instant::now() + STEP;
        loop {
            match self.lines.try_recv() {
                Ok(line) if line.starts_with(prefix) => return Ok(line),
                Ok(_) => continue,
                Err(TryRecvError::Disconnected) => {
                    return Err(format!(
                        "{} exited before printing {prefix}; its log:\n{}",
                        self.name,
                        self.stderr()
                    )
                    .into());
                }
                Err(TryRecvError::Empty) => {}
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{} printed no {prefix} line within {STEP:?}; its log:\n{}",
                    self.name,
                    self.stderr()
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits for the process to exit (it stops after its first task).
    async fn exit(&mut self) -> Result<(), BoxDynError> {
        let deadline = Instant::now() + STEP;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return if status.success() {
                    Ok(())
                } else {
                    Err(format!(
                        "{} exited with {status}; its log:\n{}",
                        self.name,
                        self.stderr()
                    )
                    .into())
                };
            }
            if Instant::now() > deadline {
                return Err(format!("{} did not exit within {STEP:?}", self.name).into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // SIGKILL by PID; a stopped process dies too.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
