//! `pgfence guard`, `unguard` and `tables`: the guard trigger on user tables.

// Printing the result is the command's job.
#![allow(clippy::print_stdout)]

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Result, bail};
use pgfence::table::TableName;
use serde_json::json;
use tokio::time::Instant;

use crate::cli::{Conn, MigrationFormat};
use crate::commands::emit;
use crate::connect::{Session, require_schema};
use crate::util::outln;
use crate::util::{self, cell, fmt_duration};

/// SQLSTATE `lock_not_available`: `lock_timeout` expired.
const LOCK_NOT_AVAILABLE: &str = "55P03";
/// SQLSTATE `insufficient_privilege`.
const INSUFFICIENT_PRIVILEGE: &str = "42501";
/// Attempts within `--lock-timeout`.
const LOCK_ATTEMPTS: u32 = 3;

/// What to do to the tables under `lock_timeout`.
#[derive(Clone, Copy)]
enum Op {
    Guard(pgfence::guard::GuardMode),
    Unguard { drop_column: bool },
}

/// The tables named on the command line, parsed as SQL reads them; a table named twice (as
/// `orders` and `public.ORDERS`, say) is refused: guarding it twice in one transaction is
/// a typo, not an intent.
fn tables_named(names: &[String]) -> Result<Vec<TableName>> {
    let mut tables: Vec<(TableName, &str)> = Vec::with_capacity(names.len());
    for name in names {
        let table = util::table(name)?;
        if let Some((_, first)) = tables.iter().find(|(t, _)| *t == table) {
            bail!(
                "table {} is named twice ({:?} and {:?}); name each table once",
                cell(&table.quoted()),
                cell(first),
                cell(name)
            );
        }
        tables.push((table, name));
    }
    if tables.is_empty() {
        bail!("no table named: give one or more tables");
    }
    Ok(tables.into_iter().map(|(t, _)| t).collect())
}

/// Runs `op` on every table of `tables` in one transaction, with `lock_timeout` set for that
/// transaction only, so that a table held by an open transaction makes it fail instead of
/// queueing behind it (and every later query on the table behind it); retries with backoff
/// while the budget `timeout` lasts. All the tables change, or none: a table that does not
/// exist, or stays busy, rolls the others back. Each attempt is its own [`Session`]: a pooled
/// server connection keeps neither the setting nor a prepared statement. Returns, per table,
/// whether it changed.
async fn with_lock_timeout(
    conn: &Conn,
    tables: &[TableName],
    timeout: Duration,
    op: Op,
) -> Result<Vec<bool>> {
    if timeout < Duration::from_millis(1) {
        bail!("--lock-timeout must be at least 1ms");
    }
    let give_up = Instant::now()
        .checked_add(timeout)
        .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365));
    let per_attempt = (timeout / LOCK_ATTEMPTS).max(Duration::from_millis(1));
    let mut backoff = Duration::from_millis(50);
    let pool = conn.pg().await?;
    // With several tables, an error says that the others were not changed either.
    let nothing_changed = format!(
        "nothing was changed (the {} tables are {} in one transaction, all or none)",
        tables.len(),
        match op {
            Op::Guard(_) => "guarded",
            Op::Unguard { .. } => "unguarded",
        }
    );
    'attempt: loop {
        let mut session = Session::begin(&pool).await?;
        require_schema(session.conn()).await?;
        let left = give_up.saturating_duration_since(Instant::now());
        let this = per_attempt.min(left).max(Duration::from_millis(1));
        // `lock_timeout` is in milliseconds; cap it at its maximum (about 24 days).
        let ms = this.as_millis().clamp(1, i32::MAX as u128).to_string();
        sqlx::query("SELECT pg_catalog.set_config('lock_timeout', $1, true)")
            .bind(&ms)
            .execute(session.conn())
            .await?;
        let mut changed = Vec::with_capacity(tables.len());
        for table in tables {
            let outcome = match op {
                Op::Guard(mode) => pgfence::guard::guard_with(session.conn(), table, mode).await,
                Op::Unguard { drop_column } => {
                    pgfence::guard::unguard(session.conn(), table, drop_column).await
                }
            };
            match outcome {
                Ok(c) => changed.push(c),
                Err(pgfence::Error::Backend(b)) if b.sqlstate() == Some(LOCK_NOT_AVAILABLE) => {
                    let left = give_up.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        let nothing = if tables.len() > 1 {
                            format!("; {nothing_changed}")
                        } else {
                            String::new()
                        };
                        bail!(
                            "table {} is busy (an open transaction holds a lock on it; waited {}){nothing}; retry or raise --lock-timeout",
                            cell(&table.quoted()),
                            fmt_duration(timeout)
                        );
                    }
                    // The session is dropped: its transaction, and every table it changed,
                    // rolls back.
                    drop(session);
                    let nap = backoff.mul_f64(0.5 + rand::random::<f64>() / 2.0).min(left);
                    tokio::time::sleep(nap).await;
                    backoff = (backoff * 2).min(Duration::from_millis(1000));
                    continue 'attempt;
                }
                Err(pgfence::Error::Backend(b)) if b.sqlstate() == Some(INSUFFICIENT_PRIVILEGE) => {
                    bail!(
                        "{}: guarding is a deploy-time command; run it as the owner of schema pgfence (the role that ran `pgfence migrate`), not as the application role",
                        b.as_sqlx()
                            .and_then(|e| e.as_database_error())
                            .map_or_else(|| b.to_string(), |db| db.message().to_owned())
                    );
                }
                Err(e) if tables.len() > 1 => {
                    return Err(anyhow::Error::from(e).context(nothing_changed));
                }
                Err(e) => return Err(e.into()),
            }
        }
        session.commit().await?;
        return Ok(changed);
    }
}

/// Guards `tables` (all or none, in one transaction), or with `emit` writes the guarding
/// migration into that folder instead, in the folder's tool's format (or `format`'s).
pub async fn guard(
    conn: &Conn,
    tables: &[String],
    emit: Option<&Path>,
    format: Option<MigrationFormat>,
    mode: pgfence::guard::GuardMode,
    lock_timeout: Duration,
) -> Result<ExitCode> {
    let tables = tables_named(tables)?;
    if let Some(dir) = emit {
        for path in emit::write_guard_migration(dir, &tables, mode, format)? {
            outln!("wrote {}", path.display())?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let changed = with_lock_timeout(conn, &tables, lock_timeout, Op::Guard(mode)).await?;
    for (table, changed) in tables.iter().zip(changed) {
        if changed {
            outln!("guarded {} ({mode})", cell(&table.quoted()))?;
        } else {
            outln!("{} was already guarded ({mode})", cell(&table.quoted()))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Removes the guard trigger from `tables` (and their `fence` column with `drop_column`),
/// all or none, in one transaction.
pub async fn unguard(
    conn: &Conn,
    tables: &[String],
    drop_column: bool,
    lock_timeout: Duration,
) -> Result<ExitCode> {
    let tables = tables_named(tables)?;
    let changed =
        with_lock_timeout(conn, &tables, lock_timeout, Op::Unguard { drop_column }).await?;
    for (table, changed) in tables.iter().zip(changed) {
        if changed {
            outln!("unguarded {}", cell(&table.quoted()))?;
        } else {
            outln!("{} was not guarded", cell(&table.quoted()))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Lists the guarded tables, one per line or as a JSON array.
pub async fn tables(conn: &Conn, json: bool) -> Result<ExitCode> {
    let pool = conn.pg_migrated().await?;
    let mut session = Session::begin(&pool).await?;
    let tables = match pgfence::guard::guarded_tables_with_modes(session.conn()).await {
        Ok(tables) => tables,
        Err(e) => {
            drop(session);
            return Err(super::needs_owner(
                &pool,
                "pgfence tables",
                "reads pgfence.guarded_tables, which an application role may not",
                e.into(),
            )
            .await);
        }
    };
    session.commit().await?;
    if json {
        let list: Vec<_> = tables
            .iter()
            .map(|g| {
                json!({
                    "schema": g.table.schema().as_str(),
                    "table": g.table.name().as_str(),
                    "mode": g.mode,
                    "enabled": g.enabled,
                })
            })
            .collect();
        outln!("{}", serde_json::Value::Array(list))?;
    } else {
        for g in tables {
            let disabled = if g.enabled { "" } else { " (trigger disabled)" };
            outln!("{}\t{}{disabled}", cell(&g.table.quoted()), g.mode)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
