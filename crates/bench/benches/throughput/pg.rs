//! Section `pg`: pgfence's [`PgIssuer`] next to what a user would pick instead on the same
//! PostgreSQL, and the Redis issuer, in the same round. No feature needed: the issuer is part
//! of pgfence, and the section uses the bench's PostgreSQL (throwaway, or `DATABASE_URL`) and
//! Redis (throwaway, or `REDIS_URL`).
//!
//! Uncontended (every task its own resource; the same tasks and pool for every row; the
//! order of 10a and 10c–10e' rotates by round):
//!
//! - 10a [`PgIssuer::acquire`] + [`PgIssuer::release`], the issuer on the bench's tuned pool
//!   ([`PgIssuer::new`]): two simple-protocol statements, `SELECT .. FROM
//!   pgfence.issuer_acquire(..)` and `SELECT pgfence.issuer_release(..)`.
//! - 10b [`PgIssuer::acquire`] of a fresh resource each time (fresh lock row and fresh counter
//!   row), on tables that hold only the section's other rows when the figure starts (as on a
//!   new deployment); the leases are released after the figure, unmeasured, and their
//!   counter rows deleted, so that every round starts from the same tables.
//! - 10b' the same with the rows of 10,000 other resources (an expired lock and a counter
//!   each) in the tables, analyzed, before the figure starts (deleted afterwards).
//! - 10c [`RedisIssuer`] acquire + release (3c), measured again in the same round.
//! - 10d `SELECT pg_try_advisory_lock($1)` + `SELECT pg_advisory_unlock($1)` on one pooled
//!   connection (sqlx prepared statements): a session-level lock, so it does not survive a
//!   transaction-mode pooler, and it carries no token.
//! - 10e a hand-written lease table: `INSERT .. ON CONFLICT DO UPDATE .. WHERE expires_at <
//!   now() RETURNING token` with a plain counter column for the token, `DELETE` to release
//!   (sqlx prepared statements). The row, and so its counter, is gone after a release: the
//!   next acquire starts at token 1 again, so these tokens do not fence anything.
//! - 10e' the same table released by expiring the row in place (`UPDATE .. SET expires_at =
//!   '-infinity'`), so the counter survives and tokens keep rising (checked per task): the
//!   least a correct hand-written lease table costs.
//! - 10f the issuer's two functions called through sqlx prepared statements (binds instead of
//!   literals) on the same pool: 10a without the simple protocol's parse and plan.
//! - 10g 10a through [`PgIssuer::connect`]: the issuer's own pool (8 connections, sqlx's
//!   default options, which ping the connection on every checkout).
//!
//! Contended (every task the same resource, one try each time, no backoff; the rate is
//! successful acquire+release cycles, the notes give attempts per second; CPU and WAL are per
//! attempt): 10h the PostgreSQL issuer, 10i advisory locks, 10j the lease table of 10e, 10k
//! the Redis issuer.
//!
//! Every PostgreSQL figure runs on connections of its own, opened after the tables were
//! vacuumed and closed after the figure, so that each figure's sessions plan their statements
//! against the same table state. The PostgreSQL server's CPU per operation comes from the same
//! `/proc` accounting as every other row (postmaster and backends; a server on another
//! machine is not measured); its WAL per operation from `pg_current_wal_lsn()` before and
//! after the figure, and the sequential scans and buffer accesses of `pgfence.issuer_lock`,
//! `pgfence.issuer_counter` and `bench_lease` from `pg_stat_user_tables` and
//! `pg_statio_user_tables` (flushed by the figure's closed sessions); all include the
//! warm-up, and 10b's also the unmeasured release.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use pgfence::{RedisIssuer, Resource, issuer::PgIssuer};
use sqlx::PgPool;

use crate::LEASE_TTL;
use crate::coord::{AcquireHeld, release_held};
use crate::measure::{Metric, NONCE, Outcome, Sample, Workload, measure};
use crate::sections::{Results, measure_redis, put};
use crate::servers::{Env, prefix, tuned_pool};
use crate::workloads::{CycleIssuer, IssuerCycle};

/// The hand-written lease table of 10e / 10e' / 10j.
const LEASE_TABLE_SQL: &str = "CREATE TABLE IF NOT EXISTS bench_lease (
    resource   text        PRIMARY KEY,
    owner      text        NOT NULL,
    token      bigint      NOT NULL,
    expires_at timestamptz NOT NULL
)";

/// 10e / 10e' / 10j acquire: take the row if it is new or expired, bump its counter.
const LEASE_ACQUIRE_SQL: &str = "INSERT INTO bench_lease AS l (resource, owner, token, expires_at)
     VALUES ($1, $2, 1, now() + make_interval(secs => $3))
     ON CONFLICT (resource) DO UPDATE
        SET owner = EXCLUDED.owner, token = l.token + 1, expires_at = EXCLUDED.expires_at
        WHERE l.expires_at < now()
     RETURNING token";

/// 10e / 10j release: delete the row if this lease still holds it.
const LEASE_DELETE_SQL: &str =
    "DELETE FROM bench_lease WHERE resource = $1 AND owner = $2 AND token = $3";

/// 10e' release: expire the row in place if this lease still holds it (the counter stays).
const LEASE_EXPIRE_SQL: &str = "UPDATE bench_lease SET expires_at = '-infinity'
     WHERE resource = $1 AND owner = $2 AND token = $3";

/// Rows of other resources in both issuer tables during 10b'.
const FILLER_ROWS: i32 = 10_000;

/// The tables the section writes, vacuumed before every figure.
const VACUUM_SQL: &str =
    "VACUUM (ANALYZE) pgfence.issuer_lock, pgfence.issuer_counter, bench_lease";

/// What one figure of the section is.
#[derive(Clone, Copy)]
enum Row {
    IssuerCycle,
    IssuerFresh,
    IssuerFreshIndexed,
    RedisCycle,
    Advisory,
    LeaseDelete,
    LeaseExpire,
    FunctionsPrepared,
    IssuerConnect,
    ContendedIssuer,
    ContendedAdvisory,
    ContendedLease,
    ContendedRedis,
}

impl Row {
    /// The key of its figure.
    fn key(self) -> &'static str {
        match self {
            Row::IssuerCycle => "pg.issuer_cycle",
            Row::IssuerFresh => "pg.issuer_fresh",
            Row::IssuerFreshIndexed => "pg.issuer_fresh_filled",
            Row::RedisCycle => "pg.redis_cycle",
            Row::Advisory => "pg.advisory_cycle",
            Row::LeaseDelete => "pg.lease_delete_cycle",
            Row::LeaseExpire => "pg.lease_expire_cycle",
            Row::FunctionsPrepared => "pg.functions_prepared",
            Row::IssuerConnect => "pg.issuer_connect_cycle",
            Row::ContendedIssuer => "pg.contended_issuer",
            Row::ContendedAdvisory => "pg.contended_advisory",
            Row::ContendedLease => "pg.contended_lease",
            Row::ContendedRedis => "pg.contended_redis",
        }
    }
}

/// `items` rotated left by `by`.
fn rotated<T: Copy>(items: &[T], by: usize) -> Vec<T> {
    let n = items.len().max(1);
    (0..items.len()).map(|i| items[(i + by) % n]).collect()
}

/// Section `pg`: 10a–10k.
pub(crate) async fn pg(env: &Env, round: usize, out: &mut Results) -> Result<()> {
    sqlx::raw_sql(LEASE_TABLE_SQL)
        .execute(&env.admin)
        .await
        .context("creating bench_lease")?;
    let redis = RedisIssuer::connect(&env.redis_url).await?;
    // Advisory lock keys of this run: high bits from the run, low bits per figure and task.
    let advisory_base = i64::from(rand::random::<u32>()) << 20;

    // Rotate the uncontended rows (and the contended ones) by round, so that drift (bloat,
    // autovacuum, the machine's other work) does not favour one of them.
    let uncontended = [
        Row::IssuerCycle,
        Row::RedisCycle,
        Row::Advisory,
        Row::LeaseDelete,
        Row::LeaseExpire,
    ];
    let contended = [
        Row::ContendedIssuer,
        Row::ContendedAdvisory,
        Row::ContendedLease,
        Row::ContendedRedis,
    ];
    let order = rotated(&uncontended, round - 1)
        .into_iter()
        .chain([
            Row::FunctionsPrepared,
            Row::IssuerConnect,
            Row::IssuerFresh,
            Row::IssuerFreshIndexed,
        ])
        .chain(rotated(&contended, round - 1));
    for row in order {
        prep_pg(env).await?;
        let sample = match row {
            Row::RedisCycle => {
                let work = IssuerCycle {
                    issuer: redis.clone(),
                    prefix: prefix(env, "pg-vs-redis"),
                };
                measure_redis(env, work).await?
            }
            Row::ContendedRedis => {
                let work = SharedCycle {
                    issuer: redis.clone(),
                    resource: Resource::new(prefix(env, "pg-contended-redis"))?,
                };
                measure_redis(env, work).await?
            }
            _ => pg_row(env, row, advisory_base).await?,
        };
        let sample = if key_is_contended(row) {
            with_attempts(sample)
        } else {
            sample
        };
        put(out, round, row.key(), sample);
    }
    Ok(())
}

/// One PostgreSQL figure, on connections of its own (opened after the vacuum, closed after
/// the figure): every figure's sessions plan the statements they run against the same, just
/// vacuumed, tables, and closing them flushes their table statistics, from which the
/// sequentially scanned tuples per operation are read.
async fn pg_row(env: &Env, row: Row, advisory_base: i64) -> Result<Sample> {
    let fresh = prefix(env, "pg-fresh");
    if matches!(row, Row::IssuerFreshIndexed) {
        fill_tables(env, &fresh).await?;
        prep_pg(env).await?;
    }
    let pool = match row {
        // The issuer's own pool: 8 connections, sqlx's default options.
        Row::IssuerConnect => PgIssuer::connect(&env.db_url).await?.pool().clone(),
        _ => tuned_pool(env, env.cfg.pool).await?,
    };
    let issuer = PgIssuer::new(pool.clone());
    let stats_before = table_stats(env).await;
    let sample = match row {
        Row::IssuerCycle | Row::IssuerConnect => {
            let work = IssuerCycle {
                issuer,
                prefix: prefix(env, "pg-cycle"),
            };
            measure_pg(env, work).await
        }
        Row::IssuerFresh | Row::IssuerFreshIndexed => {
            issuer_fresh(env, issuer, fresh.clone()).await
        }
        Row::Advisory | Row::ContendedAdvisory => {
            let work = AdvisoryCycle {
                pool: pool.clone(),
                base: advisory_base + i64::try_from(NONCE.fetch_add(1, Ordering::Relaxed))? * 1024,
                shared: matches!(row, Row::ContendedAdvisory),
            };
            measure_pg(env, work).await
        }
        Row::LeaseDelete | Row::LeaseExpire | Row::ContendedLease => {
            let work = LeaseCycle {
                pool: pool.clone(),
                prefix: prefix(env, "pg-lease"),
                shared: matches!(row, Row::ContendedLease),
                expire: matches!(row, Row::LeaseExpire),
            };
            measure_pg(env, work).await
        }
        Row::FunctionsPrepared => {
            let work = PreparedFunctions {
                pool: pool.clone(),
                key_prefix: issuer.key_prefix().to_owned(),
                prefix: prefix(env, "pg-prepared"),
            };
            measure_pg(env, work).await
        }
        Row::ContendedIssuer => {
            let work = SharedCycle {
                issuer,
                resource: Resource::new(prefix(env, "pg-contended"))?,
            };
            measure_pg(env, work).await
        }
        Row::RedisCycle | Row::ContendedRedis => unreachable!("measured by measure_redis"),
    };
    // Closed backends have flushed their statistics once they are gone.
    pool.close().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stats_after = table_stats(env).await;
    if matches!(row, Row::IssuerFresh | Row::IssuerFreshIndexed) {
        // Unmeasured: the counters 10b / 10b' created, and the filler rows of 10b'.
        sqlx::query("DELETE FROM pgfence.issuer_counter WHERE starts_with(counter, $1)")
            .bind(&fresh)
            .execute(&env.admin)
            .await?;
        sqlx::query("DELETE FROM pgfence.issuer_lock WHERE starts_with(resource, $1)")
            .bind(&fresh)
            .execute(&env.admin)
            .await?;
    }
    let mut sample = sample?;
    if let (Some((scans_a, blocks_a)), Some((scans_b, blocks_b))) = (stats_before, stats_after)
        && sample.total_ops > 0
    {
        let ops = sample.total_ops as f64;
        sample.pg_seq_scans_per_op = Some((scans_b - scans_a).max(0.0) / ops);
        sample.pg_blocks_per_op = Some((blocks_b - blocks_a).max(0.0) / ops);
    }
    Ok(sample)
}

/// Sequential scans started on the section's tables so far, and their buffer accesses (heap
/// and index blocks, hit or read), from the statistics backends have flushed.
async fn table_stats(env: &Env) -> Option<(f64, f64)> {
    sqlx::query_as::<_, (f64, f64)>(
        "SELECT coalesce(sum(s.seq_scan), 0)::float8,
                coalesce(sum(coalesce(io.heap_blks_hit, 0) + coalesce(io.heap_blks_read, 0)
                             + coalesce(io.idx_blks_hit, 0) + coalesce(io.idx_blks_read, 0)), 0)::float8
           FROM pg_stat_user_tables s JOIN pg_statio_user_tables io USING (relid)
          WHERE relid IN ('pgfence.issuer_lock'::regclass, 'pgfence.issuer_counter'::regclass,
                          'bench_lease'::regclass)",
    )
    .fetch_one(&env.admin)
    .await
    .ok()
}

/// 10b': the rows of [`FILLER_ROWS`] other resources — an expired lock each and a counter
/// each — under `prefix`, as an issuer that has served that many resources keeps them.
async fn fill_tables(env: &Env, prefix: &str) -> Result<()> {
    sqlx::query(
        "INSERT INTO pgfence.issuer_counter (prefix, counter, value)
         SELECT 'pgfence', $1 || ':filler:' || g, 1 FROM generate_series(1, $2) g",
    )
    .bind(prefix)
    .bind(FILLER_ROWS)
    .execute(&env.admin)
    .await?;
    sqlx::query(
        "INSERT INTO pgfence.issuer_lock (prefix, resource, owner, token, expires_at)
         SELECT 'pgfence', $1 || ':filler:' || g, 'gone', 1, now() - interval '1 hour'
           FROM generate_series(1, $2) g",
    )
    .bind(prefix)
    .bind(FILLER_ROWS)
    .execute(&env.admin)
    .await?;
    Ok(())
}

/// Whether `row` is one of the contended figures.
fn key_is_contended(row: Row) -> bool {
    matches!(
        row,
        Row::ContendedIssuer | Row::ContendedAdvisory | Row::ContendedLease | Row::ContendedRedis
    )
}

/// A contended figure's note: attempts per second and the share refused as busy.
fn with_attempts(mut sample: Sample) -> Sample {
    let attempts = sample.applied + sample.rejected;
    if sample.note.is_none() && attempts > 0 && sample.seconds > 0.0 {
        sample.note = Some(format!(
            "{:.0} attempts/s, {:.0}% busy",
            attempts as f64 / sample.seconds,
            sample.rejected as f64 * 100.0 / attempts as f64
        ));
    }
    sample
}

/// 10b / 10b': fresh resources named under `fresh`; the leases released afterwards
/// (unmeasured).
async fn issuer_fresh(env: &Env, issuer: PgIssuer, fresh: String) -> Result<Sample> {
    let held = Arc::new(Mutex::new(Vec::new()));
    let work = AcquireHeld {
        issuer: issuer.clone(),
        prefix: fresh,
        held: Arc::clone(&held),
    };
    let sample = measure_pg(env, work).await;
    release_held(&held, env.cfg.tasks, move |lease| {
        let issuer = issuer.clone();
        async move {
            let _ = issuer.release(&lease).await;
        }
    })
    .await;
    sample
}

/// Vacuums the section's tables and asks for a checkpoint (best effort), so that every
/// figure starts from the same state.
async fn prep_pg(env: &Env) -> Result<()> {
    sqlx::raw_sql(VACUUM_SQL).execute(&env.admin).await?;
    let _ = sqlx::raw_sql("CHECKPOINT").execute(&env.admin).await;
    Ok(())
}

/// The server's WAL position in bytes, when it can be read.
async fn wal_bytes(env: &Env) -> Option<f64> {
    sqlx::query_scalar::<_, f64>("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8")
        .fetch_one(&env.admin)
        .await
        .ok()
}

/// Runs `work` like [`measure`], and also reads the WAL written per operation.
async fn measure_pg<W: Workload>(env: &Env, work: W) -> Result<Sample> {
    let before = wal_bytes(env).await;
    let mut sample = measure(&env.cfg, env.cfg.tasks, Metric::Applied, work).await?;
    let after = wal_bytes(env).await;
    if let (Some(a), Some(b)) = (before, after)
        && sample.total_ops > 0
    {
        sample.pg_wal_bytes_per_op = Some((b - a).max(0.0) / sample.total_ops as f64);
    }
    Ok(sample)
}

/// 10h / 10k: acquire + release of one resource all tasks share; a busy lock is a rejection.
struct SharedCycle<I> {
    issuer: I,
    resource: Resource,
}

impl<I: CycleIssuer> Workload for SharedCycle<I> {
    type State = ();

    fn state(&self, _task: usize) -> Self::State {}

    async fn op(&self, (): &mut Self::State) -> Outcome {
        match self.issuer.acquire(&self.resource, LEASE_TTL).await {
            Ok(Some(lease)) => match self.issuer.release(&lease).await {
                Ok(pgfence::issuer::ReleaseOutcome::Released) => Outcome::Applied,
                Ok(state) => Outcome::Failed(format!("release found {state:?}")),
                Err(e) => Outcome::Failed(e.to_string()),
            },
            Ok(None) => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// 10d / 10i: `pg_try_advisory_lock` + `pg_advisory_unlock` on one pooled connection.
struct AdvisoryCycle {
    pool: PgPool,
    /// Task `i` locks `base + i`; every task locks `base` when `shared`.
    base: i64,
    shared: bool,
}

impl Workload for AdvisoryCycle {
    type State = i64;

    fn state(&self, task: usize) -> Self::State {
        if self.shared {
            self.base
        } else {
            self.base + i64::try_from(task).expect("task index fits i64")
        }
    }

    async fn op(&self, key: &mut Self::State) -> Outcome {
        let run = async {
            let mut conn = self.pool.acquire().await?;
            let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                .bind(*key)
                .fetch_one(&mut *conn)
                .await?;
            if !locked {
                return Ok(None);
            }
            let unlocked: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                .bind(*key)
                .fetch_one(&mut *conn)
                .await?;
            Ok::<_, sqlx::Error>(Some(unlocked))
        };
        match run.await {
            Ok(Some(true)) => Outcome::Applied,
            Ok(Some(false)) => Outcome::Failed("pg_advisory_unlock returned false".into()),
            Ok(None) => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// 10e / 10e' / 10j: the hand-written lease table.
struct LeaseCycle {
    pool: PgPool,
    prefix: String,
    /// Every task on one resource.
    shared: bool,
    /// Release by expiring the row in place (10e') instead of deleting it.
    expire: bool,
}

impl Workload for LeaseCycle {
    /// The resource, and the last token this task got (10e' checks they rise).
    type State = (String, i64);

    fn state(&self, task: usize) -> Self::State {
        if self.shared {
            (self.prefix.clone(), 0)
        } else {
            (format!("{}:{task}", self.prefix), 0)
        }
    }

    async fn op(&self, (resource, last): &mut Self::State) -> Outcome {
        let owner = pgfence::Lease::new_owner_id();
        let ttl_secs = LEASE_TTL.as_secs_f64();
        let run = async {
            let token: Option<i64> = sqlx::query_scalar(LEASE_ACQUIRE_SQL)
                .bind(resource.as_str())
                .bind(&owner)
                .bind(ttl_secs)
                .fetch_optional(&self.pool)
                .await?;
            let Some(token) = token else {
                return Ok(None);
            };
            let release = if self.expire {
                LEASE_EXPIRE_SQL
            } else {
                LEASE_DELETE_SQL
            };
            let done = sqlx::query(release)
                .bind(resource.as_str())
                .bind(&owner)
                .bind(token)
                .execute(&self.pool)
                .await?;
            Ok::<_, sqlx::Error>(Some((token, done.rows_affected())))
        };
        match run.await {
            Ok(None) => Outcome::Rejected,
            Ok(Some((token, 1))) => {
                let previous = std::mem::replace(last, token);
                if !self.expire || self.shared || token > previous {
                    Outcome::Applied
                } else {
                    Outcome::Failed(format!("token {token} after {previous}"))
                }
            }
            Ok(Some((_, n))) => Outcome::Failed(format!("release changed {n} rows")),
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// 10f: the issuer's functions through sqlx prepared statements.
struct PreparedFunctions {
    pool: PgPool,
    /// The issuer's key prefix (`pgfence`).
    key_prefix: String,
    /// Resource names: `{prefix}:{task}`.
    prefix: String,
}

impl Workload for PreparedFunctions {
    type State = String;

    fn state(&self, task: usize) -> Self::State {
        format!("{}:{task}", self.prefix)
    }

    async fn op(&self, resource: &mut Self::State) -> Outcome {
        let owner = pgfence::Lease::new_owner_id();
        let ttl_ms = i64::try_from(LEASE_TTL.as_millis()).expect("ttl fits i64");
        let run = async {
            let (acquired, token): (bool, Option<i64>) = sqlx::query_as(
                "SELECT acquired, token FROM pgfence.issuer_acquire($1, $2, $3, $4)",
            )
            .bind(&self.key_prefix)
            .bind(resource.as_str())
            .bind(&owner)
            .bind(ttl_ms)
            .fetch_one(&self.pool)
            .await?;
            let Some(token) = token.filter(|_| acquired) else {
                return Ok(None);
            };
            let code: i32 = sqlx::query_scalar("SELECT pgfence.issuer_release($1, $2, $3, $4)")
                .bind(&self.key_prefix)
                .bind(resource.as_str())
                .bind(&owner)
                .bind(token)
                .fetch_one(&self.pool)
                .await?;
            Ok::<_, sqlx::Error>(Some(code))
        };
        match run.await {
            Ok(Some(1)) => Outcome::Applied,
            Ok(Some(code)) => Outcome::Failed(format!("issuer_release returned {code}")),
            Ok(None) => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}
