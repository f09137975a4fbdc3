//! `pgfence guard`, `unguard` and `tables`: the guard trigger on user tables.

// Printing the result is the command's job.
#![allow(clippy::print_stdout)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use pgfence::table::TableName;
use serde_json::json;
use tokio::time::Instant;

use crate::cli::Conn;
use crate::connect::{Session, require_schema};
use crate::util::outln;
use crate::util::{self, cell, fmt_duration};

/// SQLSTATE `lock_not_available`: `lock_timeout` expired.
const LOCK_NOT_AVAILABLE: &str = "55P03";
/// SQLSTATE `insufficient_privilege`.
const INSUFFICIENT_PRIVILEGE: &str = "42501";
/// Attempts within `--lock-timeout`.
const LOCK_ATTEMPTS: u32 = 3;

/// What to do to the table under `lock_timeout`.
#[derive(Clone, Copy)]
enum Op {
    Guard(pgfence::guard::GuardMode),
    Unguard { drop_column: bool },
}

/// Runs `op` in a transaction with `lock_timeout` set for that transaction only, so that a
/// table held by an open transaction makes it fail instead of queueing behind it (and every
/// later query on the table behind it); retries with backoff while the budget `timeout`
/// lasts. Each attempt is its own [`Session`]: a pooled server connection keeps neither the
/// setting nor a prepared statement.
async fn with_lock_timeout(
    conn: &Conn,
    table: &TableName,
    timeout: Duration,
    op: Op,
) -> Result<bool> {
    if timeout < Duration::from_millis(1) {
        bail!("--lock-timeout must be at least 1ms");
    }
    let give_up = Instant::now()
        .checked_add(timeout)
        .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365));
    let per_attempt = (timeout / LOCK_ATTEMPTS).max(Duration::from_millis(1));
    let mut backoff = Duration::from_millis(50);
    let pool = conn.pg().await?;
    loop {
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
        let outcome = match op {
            Op::Guard(mode) => pgfence::guard::guard_with(session.conn(), table, mode).await,
            Op::Unguard { drop_column } => {
                pgfence::guard::unguard(session.conn(), table, drop_column).await
            }
        };
        match outcome {
            Err(pgfence::Error::Backend(b)) if b.sqlstate() == Some(LOCK_NOT_AVAILABLE) => {
                let left = give_up.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    bail!(
                        "table {} is busy (an open transaction holds a lock on it; waited {}); retry or raise --lock-timeout",
                        cell(&table.quoted()),
                        fmt_duration(timeout)
                    );
                }
                let nap = backoff.mul_f64(0.5 + rand::random::<f64>() / 2.0).min(left);
                tokio::time::sleep(nap).await;
                backoff = (backoff * 2).min(Duration::from_millis(1000));
            }
            Err(pgfence::Error::Backend(b)) if b.sqlstate() == Some(INSUFFICIENT_PRIVILEGE) => {
                bail!(
                    "{}: guarding is a deploy-time command; run it as the owner of schema pgfence (the role that ran `pgfence migrate`), not as the application role",
                    b.as_sqlx()
                        .and_then(|e| e.as_database_error())
                        .map_or_else(|| b.to_string(), |db| db.message().to_owned())
                );
            }
            other => {
                let changed = other?;
                session.commit().await?;
                return Ok(changed);
            }
        }
    }
}

/// Guards `table`, or with `emit` writes the guarding migration into that folder instead.
pub async fn guard(
    conn: &Conn,
    table: &str,
    emit: Option<&Path>,
    mode: pgfence::guard::GuardMode,
    lock_timeout: Duration,
) -> Result<ExitCode> {
    let table = util::table(table)?;
    if let Some(dir) = emit {
        let path = emit_migration(dir, &table, mode)?;
        outln!("wrote {}", path.display())?;
        return Ok(ExitCode::SUCCESS);
    }
    let changed = with_lock_timeout(conn, &table, lock_timeout, Op::Guard(mode)).await?;
    if changed {
        outln!("guarded {} ({mode})", cell(&table.quoted()))?;
    } else {
        outln!("{} was already guarded ({mode})", cell(&table.quoted()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes `V{n}__guard_<table>.sql` after the highest version in a refinery folder.
fn emit_migration(
    dir: &Path,
    table: &TableName,
    mode: pgfence::guard::GuardMode,
) -> Result<PathBuf> {
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read migrations folder {}", dir.display()))?;
    let mut highest: u64 = 0;
    for entry in entries {
        let name = entry?.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = name.strip_prefix(['V', 'U', 'v', 'u']) else {
            continue;
        };
        let Some((version, _)) = rest.split_once("__") else {
            continue;
        };
        if let Ok(v) = version.parse::<u64>() {
            highest = highest.max(v);
        }
    }
    let safe: String = format!("{}_{}", table.schema().as_str(), table.name().as_str())
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    let safe = safe.strip_prefix("public_").unwrap_or(&safe).to_owned();
    let path = dir.join(format!("V{}__guard_{safe}.sql", highest + 1));
    let sql = pgfence::guard::guard_migration_sql_with(table, mode)?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    std::io::Write::write_all(&mut file, sql.as_bytes())?;
    Ok(path)
}

/// Removes the guard trigger from `table` (and its `fence` column with `drop_column`).
pub async fn unguard(
    conn: &Conn,
    table: &str,
    drop_column: bool,
    lock_timeout: Duration,
) -> Result<ExitCode> {
    let table = util::table(table)?;
    let changed =
        with_lock_timeout(conn, &table, lock_timeout, Op::Unguard { drop_column }).await?;
    if changed {
        outln!("unguarded {}", cell(&table.quoted()))?;
    } else {
        outln!("{} was not guarded", cell(&table.quoted()))?;
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
