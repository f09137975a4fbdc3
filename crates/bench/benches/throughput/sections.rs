//! What each section measures, one round at a time, and the unmeasured conditioning run.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use anyhow::Result;
use pgfence::{RedisIssuer, Repository, Resource};
use redis::aio::ConnectionManager;
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, SqlSafeStr};

use crate::baselines::{
    HandRolledCycle, RslockCycle, pgbench_batch_row, pgbench_row, pgbench_row_with,
    redis_benchmark_row,
};
use crate::cpu::redis_usec;
use crate::measure::{Metric, Sample, TOKENS, Workload, lease_fence, measure};
use crate::servers::{Env, audit_rows, prefix, prep, redis_conn, resync_tokens, tuned_pool};
use crate::workloads::{
    AcquireFresh, BatchUpdate, ClaimUpdate, FENCED_UPDATE_SQL, GuardedRow, IssuerCycle, JobCycle,
    PLAIN_UPDATE_SQL, PlainUpdate, RawFencedSql, RepoWrite,
};

/// One round's figures, by key (`write.repo_update`...).
pub(crate) type Results = BTreeMap<String, Sample>;

/// Records `sample` under `key` and prints a progress line.
pub(crate) fn put(out: &mut Results, round: usize, key: &str, sample: Sample) {
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
pub(crate) async fn condition(env: &Env) -> Result<()> {
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
        gated: false,
    };
    measure(cfg, tasks, Metric::Applied, work).await?;
    if cfg.runs("parts") {
        let work = RawFencedSql {
            pool: pool.clone(),
            sql: AssertSqlSafe(crate::parts::unguarded_sql(env)).into_sql_str(),
            tasks,
            rows,
            timeline: Some(env.timeline),
        };
        measure(cfg, tasks, Metric::Applied, work).await?;
    }
    let work = JobCycle {
        issuer: RedisIssuer::connect(&env.redis_url).await?,
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

/// Section `write`: 1a–1g.
pub(crate) async fn write(env: &Env, round: usize, out: &mut Results) -> Result<()> {
    let cfg = &env.cfg;
    let (tasks, rows) = (cfg.tasks, cfg.rows);
    let pool = tuned_pool(env, cfg.pool).await?;
    let repo = Repository::<GuardedRow>::new(pool.clone())?;
    // Rotate the order by round, so drift (bloat, autovacuum) does not favour one variant.
    for i in 0..6 {
        prep(env).await?;
        let pool = pool.clone();
        let (key, sample) = match (i + round) % 6 {
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
                let work = PlainUpdate {
                    pool,
                    tasks,
                    rows,
                    gated: false,
                };
                (
                    "write.plain_update",
                    measure(cfg, tasks, Metric::Applied, work).await?,
                )
            }
            5 => {
                let work = PlainUpdate {
                    pool,
                    tasks,
                    rows,
                    gated: true,
                };
                (
                    "write.plain_update_gated",
                    measure(cfg, tasks, Metric::Applied, work).await?,
                )
            }
            2 => {
                let sql = AssertSqlSafe(env.repo_sql.clone()).into_sql_str();
                // The repository binds the timeline its leases are bound to: the database's.
                let work = RawFencedSql {
                    pool,
                    sql,
                    tasks,
                    rows,
                    timeline: Some(env.timeline),
                };
                (
                    "write.raw_repo_sql",
                    measure(cfg, tasks, Metric::Applied, work).await?,
                )
            }
            3 => {
                let work = ClaimUpdate {
                    pool,
                    repo: repo.clone(),
                    tasks,
                    rows,
                };
                (
                    "write.claim_update",
                    measure(cfg, tasks, Metric::Applied, work).await?,
                )
            }
            _ => {
                let work = RawFencedSql {
                    pool,
                    sql: FENCED_UPDATE_SQL.into_sql_str(),
                    tasks,
                    rows,
                    timeline: None,
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

/// Section `pgbench`: 1b, 1d and 1c through pgbench (2b, 2d, 2c).
pub(crate) async fn pgbench(env: &Env, round: usize, out: &mut Results) -> Result<()> {
    for (key, table, body) in pgbench_rows(env)? {
        let name = key.trim_start_matches("pgbench.");
        let sample = pgbench_row(env, name, table, &body).await?;
        put(out, round, key, sample);
    }
    Ok(())
}

/// The pgbench rows: key, table, script body.
fn pgbench_rows(env: &Env) -> Result<[(&'static str, &'static str, String); 3]> {
    // The repository's parameters, in the order it binds them (`Repository::update_sql`): the
    // key, the payload, the lease fence (see `RawFencedSql`; `:tok` steps through the lease
    // fences of successive tokens, see `pgbench_row`) and the lease's timeline (`:timeline`,
    // the database's, as the repository binds it for a bare token; see `Env::timeline`).
    // pgbench gives every `:var` occurrence its own parameter, with no type from the client:
    // the server infers the same types sqlx sends (the statement casts the timeline itself).
    let repo_body = pgfence_bench::pgbench_params(
        &env.repo_sql,
        &[":id", ":payload", ":tok", ":timeline", "0"],
    )
    .map_err(anyhow::Error::msg)?;
    let plain_body = pgfence_bench::pgbench_params(PLAIN_UPDATE_SQL, &[":payload", ":id"])
        .map_err(anyhow::Error::msg)?;
    let fenced_body =
        pgfence_bench::pgbench_params(FENCED_UPDATE_SQL, &[":id", ":payload", ":tok"])
            .map_err(anyhow::Error::msg)?;
    Ok([
        ("pgbench.plain_update", "bench_plain", plain_body),
        ("pgbench.fenced_plain_sql", "bench_guarded", fenced_body),
        ("pgbench.repo_sql", "bench_guarded", repo_body),
    ])
}

/// Batch sizes of section `batch`.
pub(crate) const BATCH_SIZES: [usize; 3] = [10, 100, 1000];

/// Concurrency of the batch rows of `size` rows: the configured tasks, fewer when a task's
/// share of the rows (`rows / tasks`) is smaller than a batch (a batch names distinct rows,
/// and tasks write disjoint rows). 16 tasks over 10,000 rows: 16, 16 and 10.
pub(crate) fn batch_tasks(tasks: usize, rows: i32, size: usize) -> usize {
    let rows = usize::try_from(rows).unwrap_or(0);
    tasks.min(rows / size.max(1))
}

/// Section `batch`: [`Repository::update_many`](pgfence::Repository::update_many) batches of
/// 10, 100 and 1,000 rows (7a) and the same statement through pgbench (7c, the Postgres-side
/// ceiling), against this round's per-row figures: 1a (`Repository::update`) and 2d (the
/// fenced statement through pgbench), measured here when their sections are not selected.
pub(crate) async fn batch(env: &Env, round: usize, out: &mut Results) -> Result<()> {
    let cfg = &env.cfg;
    if !cfg.runs("write") {
        let pool = tuned_pool(env, cfg.pool).await?;
        prep(env).await?;
        let work = RepoWrite {
            repo: Repository::new(pool.clone())?,
            pool: pool.clone(),
            tasks: cfg.tasks,
            rows: cfg.rows,
            stale_every: 0,
            context: None,
        };
        let sample = measure(cfg, cfg.tasks, Metric::Applied, work).await?;
        put(out, round, "write.repo_update", sample);
        pool.close().await;
    }
    if !cfg.runs("pgbench") {
        let [_, (key, table, body), _] = pgbench_rows(env)?;
        let sample = pgbench_row(env, key.trim_start_matches("pgbench."), table, &body).await?;
        put(out, round, key, sample);
    }
    for size in BATCH_SIZES {
        let tasks = batch_tasks(cfg.tasks, cfg.rows, size);
        let (key, ceiling_key) = (
            format!("batch.update_many_{size}"),
            format!("batch.ceiling_{size}"),
        );
        if tasks == 0 {
            let why = format!("a batch of {size} needs at least {size} rows");
            put(out, round, &key, Sample::skipped(why.clone()));
            put(out, round, &ceiling_key, Sample::skipped(why));
            continue;
        }
        // Alternate which of the two goes first, so drift does not favour one.
        let even = round.is_multiple_of(2);
        for rust in [even, !even] {
            if rust {
                let pool = tuned_pool(env, cfg.pool.min(u32::try_from(tasks)?)).await?;
                prep(env).await?;
                let work = BatchUpdate {
                    repo: Repository::new(pool.clone())?,
                    pool: pool.clone(),
                    tasks,
                    rows: cfg.rows,
                    size,
                };
                let mut sample = measure(cfg, tasks, Metric::Applied, work).await?;
                sample.per_row(u64::try_from(size)?);
                put(out, round, &key, sample);
                pool.close().await;
            } else {
                let sample = match &env.batch_sql {
                    Ok(sql) => {
                        let name = format!("batch_ceiling_{size}");
                        pgbench_batch_row(env, &name, sql, size, tasks).await?
                    }
                    Err(why) => Sample::skipped(format!("no batch statement: {why}")),
                };
                put(out, round, &ceiling_key, sample);
            }
        }
    }
    Ok(())
}

/// Runs `work` like [`measure`], and also reads Redis's command time per operation.
pub(crate) async fn measure_redis<W: Workload>(env: &Env, work: W) -> Result<Sample> {
    let mut conn = redis_conn(&env.redis_url).await?;
    let before = redis_usec(&mut conn).await;
    let mut sample = measure(&env.cfg, env.cfg.tasks, Metric::Applied, work).await?;
    let after = redis_usec(&mut conn).await;
    let ops = sample.total_ops;
    sample.redis_cpu(before, after, ops);
    Ok(sample)
}

/// Section `acquire`: 3a–3e.
pub(crate) async fn acquire(env: &Env, round: usize, out: &mut Results) -> Result<()> {
    let cfg = &env.cfg;
    let issuer = RedisIssuer::connect(&env.redis_url).await?;

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

    // The issuer on one multiplexed connection (what `RedisIssuer::connect` opened before it
    // opened one per CPU).
    let client = redis::Client::open(env.redis_url.as_str())?;
    let work = IssuerCycle {
        issuer: RedisIssuer::new(ConnectionManager::new(client).await?),
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

/// Section `job`: 4.
pub(crate) async fn job(env: &Env, round: usize, out: &mut Results) -> Result<()> {
    let cfg = &env.cfg;
    let pool = tuned_pool(env, cfg.pool).await?;
    prep(env).await?;
    let work = JobCycle {
        issuer: RedisIssuer::connect(&env.redis_url).await?,
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
pub(crate) struct AuditCheck {
    pub(crate) what: String,
    pub(crate) rejections: u64,
    pub(crate) audit_rows: i64,
    pub(crate) pass: bool,
}

/// Section `storm`: 5a–5c, each with its audit check.
pub(crate) async fn storm(
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
        .bind(lease_fence(high))
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

/// Concurrencies of section `coalesce`.
pub(crate) const COALESCE_TASKS: [usize; 3] = [1, 16, 64];

/// Section `coalesce`: `Repository::update` (13a), the same updates through a
/// [`Coalescer`](pgfence::repository::Coalescer) (13b) and pgbench running the repository's
/// statement (13c), at 1, 16 and 64 tasks (pool: the tasks, at most 64; pgbench: as many
/// clients).
pub(crate) async fn coalesce(env: &Env, round: usize, out: &mut Results) -> Result<()> {
    let cfg = &env.cfg;
    let body = pgbench_rows(env)?
        .into_iter()
        .find(|(key, ..)| *key == "pgbench.repo_sql")
        .map(|(_, _, body)| body)
        .unwrap_or_default();
    for tasks in COALESCE_TASKS {
        let pool = tuned_pool(env, u32::try_from(tasks.min(64))?).await?;
        let repo = Repository::<crate::workloads::GuardedRow>::new(pool.clone())?;
        // Alternate which of 13a and 13b goes first by round, so drift favours neither.
        let update_first = round % 2 == 1;
        if update_first {
            coalesce_baseline(env, round, out, &repo, &pool, tasks).await?;
        }
        prep(env).await?;
        // PGFENCE_BENCH_COALESCE_LANES: lanes to try instead of the default (tuning).
        let lanes = std::env::var("PGFENCE_BENCH_COALESCE_LANES")
            .ok()
            .and_then(|l| l.parse().ok())
            .unwrap_or(pgfence::repository::DEFAULT_LANES);
        let writer = repo
            .clone()
            .coalesced(pool.clone())
            .with_lanes(lanes, pgfence::repository::DEFAULT_MAX_GROUP);
        let work = crate::workloads::CoalescedWrite {
            writer: writer.clone(),
            tasks,
            rows: cfg.rows,
        };
        let mut sample = measure(cfg, tasks, Metric::Applied, work).await?;
        let stats = writer.stats();
        sample.note = Some(format!(
            "{} alone, {} statements carrying {} ({:.1}/statement), {} chained, {} re-sent",
            stats.alone,
            stats.statements,
            stats.carried,
            stats.carried as f64 / stats.statements.max(1) as f64,
            stats.chained,
            stats.resent
        ));
        put(out, round, &format!("coalesce.coalesced_c{tasks}"), sample);
        if !update_first {
            coalesce_baseline(env, round, out, &repo, &pool, tasks).await?;
        }
        pool.close().await;
        if tasks > 1 {
            prep(env).await?;
            let sample = pgbench_row_with(
                env,
                &format!("coalesce_c{tasks}"),
                "bench_guarded",
                &body,
                tasks,
            )
            .await?;
            put(out, round, &format!("coalesce.pgbench_c{tasks}"), sample);
        }
    }
    Ok(())
}

/// 13a: `Repository::update` at `tasks` tasks.
async fn coalesce_baseline(
    env: &Env,
    round: usize,
    out: &mut Results,
    repo: &Repository<crate::workloads::GuardedRow>,
    pool: &sqlx::PgPool,
    tasks: usize,
) -> Result<()> {
    prep(env).await?;
    let work = RepoWrite {
        repo: repo.clone(),
        pool: pool.clone(),
        tasks,
        rows: env.cfg.rows,
        stale_every: 0,
        context: None,
    };
    let sample = measure(&env.cfg, tasks, Metric::Applied, work).await?;
    put(out, round, &format!("coalesce.update_c{tasks}"), sample);
    Ok(())
}

/// Section `scaling`: 1a at each concurrency of `PGFENCE_BENCH_SCALING`.
pub(crate) async fn scaling(env: &Env, round: usize, out: &mut Results) -> Result<()> {
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
