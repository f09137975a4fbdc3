//! Section `parts` (rows 11a–11g): the fenced + guarded write taken apart, every part against
//! the same plain `UPDATE`, in one round (issue 34 point 2; 11e/11d and 11f/11g are issue 33's
//! "timeline check on / off" figure).
//!
//! - 11a: the plain `UPDATE` of 1b (no `fence` column, no trigger): the baseline.
//! - 11b: the repository's exact update SQL on `bench_unguarded`, a copy of the guarded table
//!   (same `fence` column) **without** the guard trigger, timeline bound to 0 (the statement's
//!   `$4 = 0 OR $4 = pgfence.timeline()` stops at `$4 = 0`: no WAL read): the `WHERE` / `CASE`
//!   arithmetic alone.
//! - 11c: 11b with the database's timeline bound (as the repository binds it): arithmetic +
//!   the timeline read (`pgfence.timeline()`, inlined: `pg_walfile_name(pg_current_wal_lsn())`).
//! - 11d: the same statement on the guarded table, timeline 0: arithmetic + the trigger
//!   (`BEFORE UPDATE ... WHEN (NEW.fence <= (OLD.fence | ...))`, evaluated per row, never
//!   firing for a fresh write).
//! - 11e: 11d with the timeline bound: the whole statement (= 1c).
//! - 11f: `Repository::update` with the database's timeline check on (= 1a).
//! - 11g: `Repository::update` with the timeline check **off for the database**: the bench
//!   revokes `EXECUTE` on `pg_catalog.pg_current_wal_lsn()` from `PUBLIC` in its own database
//!   and runs `pgfence.configure_timeline()`, which then redefines `pgfence.timeline()` as 0
//!   (what it does on Aurora without logical replication); a new repository then binds its
//!   leases to timeline 0. The grant and the check are restored right after the figure.
//!   Skipped, with a note, when the bench's role may not change that grant.

use anyhow::{Context, Result};
use pgfence::Repository;
use sqlx::{AssertSqlSafe, PgPool, SqlSafeStr};

use crate::measure::{Metric, Sample, measure};
use crate::sections::{Results, put};
use crate::servers::{Env, prep, tuned_pool};
use crate::workloads::{GuardedRow, PlainUpdate, RawFencedSql, RepoWrite};

/// The copy of `bench_guarded` without the trigger (created with the other tables).
pub(crate) const UNGUARDED_TABLE: &str = "bench_unguarded";

/// The repository's update SQL for `bench_guarded`, aimed at the unguarded copy.
pub(crate) fn unguarded_sql(env: &Env) -> String {
    env.repo_sql
        .replace("\"bench_guarded\"", &format!("\"{UNGUARDED_TABLE}\""))
}

/// Switches the database's timeline check on or off (see the module docs); returns what
/// `pgfence.configure_timeline()` decided.
async fn timeline_check(admin: &PgPool, on: bool) -> Result<bool> {
    let grant = if on {
        "GRANT EXECUTE ON FUNCTION pg_catalog.pg_current_wal_lsn() TO PUBLIC"
    } else {
        "REVOKE EXECUTE ON FUNCTION pg_catalog.pg_current_wal_lsn() FROM PUBLIC"
    };
    sqlx::raw_sql(AssertSqlSafe(grant.to_owned()))
        .execute(admin)
        .await
        .with_context(|| grant.to_owned())?;
    let enabled: bool = sqlx::query_scalar("SELECT pgfence.configure_timeline()")
        .fetch_one(admin)
        .await?;
    Ok(enabled)
}

/// Section `parts`: 11a–11g, in an order rotated by round.
pub(crate) async fn parts(env: &Env, round: usize, out: &mut Results) -> Result<()> {
    let cfg = &env.cfg;
    let (tasks, rows) = (cfg.tasks, cfg.rows);
    let pool = tuned_pool(env, cfg.pool).await?;
    let repo = Repository::<GuardedRow>::new(pool.clone())?;
    let unguarded = unguarded_sql(env);
    if unguarded == env.repo_sql {
        anyhow::bail!(
            "the repository's SQL does not name \"bench_guarded\": {}",
            env.repo_sql
        );
    }
    const N: usize = 6;
    for i in 0..N {
        prep(env).await?;
        let raw = |sql: &str, timeline: i64| RawFencedSql {
            pool: pool.clone(),
            sql: AssertSqlSafe(sql.to_owned()).into_sql_str(),
            tasks,
            rows,
            timeline: Some(timeline),
        };
        let (key, sample) = match (i + round) % N {
            0 => {
                let work = PlainUpdate {
                    pool: pool.clone(),
                    tasks,
                    rows,
                    gated: false,
                };
                (
                    "parts.plain",
                    measure(cfg, tasks, Metric::Applied, work).await?,
                )
            }
            1 => {
                let work = raw(&unguarded, 0);
                (
                    "parts.unguarded_tl0",
                    measure(cfg, tasks, Metric::Applied, work).await?,
                )
            }
            2 => {
                let work = raw(&unguarded, env.timeline);
                (
                    "parts.unguarded",
                    measure(cfg, tasks, Metric::Applied, work).await?,
                )
            }
            3 => {
                let work = raw(&env.repo_sql, 0);
                (
                    "parts.guarded_tl0",
                    measure(cfg, tasks, Metric::Applied, work).await?,
                )
            }
            4 => {
                let work = raw(&env.repo_sql, env.timeline);
                (
                    "parts.guarded",
                    measure(cfg, tasks, Metric::Applied, work).await?,
                )
            }
            _ => {
                let work = RepoWrite {
                    pool: pool.clone(),
                    repo: repo.clone(),
                    tasks,
                    rows,
                    stale_every: 0,
                    context: None,
                };
                (
                    "parts.repo",
                    measure(cfg, tasks, Metric::Applied, work).await?,
                )
            }
        };
        put(out, round, key, sample);
    }
    pool.close().await;

    // 11g: the timeline check off for the database, on connections opened after the switch.
    prep(env).await?;
    let switched = timeline_check(&env.admin, false).await;
    let sample = match &switched {
        Ok(false) => {
            let pool = tuned_pool(env, cfg.pool).await?;
            let timeline: i64 = sqlx::query_scalar("SELECT pgfence.timeline()")
                .fetch_one(&pool)
                .await?;
            let work = RepoWrite {
                repo: Repository::new(pool.clone())?,
                pool: pool.clone(),
                tasks,
                rows,
                stale_every: 0,
                context: None,
            };
            let measured = measure(cfg, tasks, Metric::Applied, work).await;
            pool.close().await;
            let mut sample = measured?;
            if timeline != 0 {
                sample.problem = Some(format!(
                    "the timeline check did not switch off: pgfence.timeline() = {timeline}"
                ));
            }
            sample
        }
        Ok(true) => Sample::skipped("configure_timeline() kept the check on"),
        Err(e) => Sample::skipped(format!("cannot switch the timeline check off: {e:#}")),
    };
    put(out, round, "parts.repo_tl_off", sample);
    // The check back on, as the other sections expect it (when the grant could be changed).
    if switched.is_ok() && !timeline_check(&env.admin, true).await? && env.timeline != 0 {
        anyhow::bail!("the timeline check could not be switched back on");
    }
    Ok(())
}
