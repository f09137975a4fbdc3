//! `pgfence audit`: list rejected writes, or prune old audit rows.

// Printing the result is the command's job.
#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use pgfence::AuditFilter;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::cli::Conn;
use crate::util::{self, cell, print_table};

/// `older_than` before now, or an error naming `flag` when that is before the year -9999.
fn ago(flag: &str, older_than: Duration) -> Result<OffsetDateTime> {
    time::Duration::try_from(older_than)
        .ok()
        .and_then(|d| OffsetDateTime::now_utc().checked_sub(d))
        .with_context(|| {
            format!(
                "{flag} {}: too far back (the earliest date is the year -9999)",
                util::fmt_duration(older_than)
            )
        })
}

fn parse_since(s: &str) -> Result<OffsetDateTime> {
    if let Ok(d) = util::parse_duration(s) {
        return ago("--since", d);
    }
    OffsetDateTime::parse(s, &Rfc3339).with_context(|| {
        format!(
            "--since {:?}: expected a duration (1h, 30m) or an RFC 3339 time",
            cell(&util::shorten(s))
        )
    })
}

/// Prints rejected writes (newest first) as a table or one JSON array.
pub async fn list(
    conn: &Conn,
    since: Option<&str>,
    resource: Option<String>,
    limit: i64,
    json: bool,
) -> Result<ExitCode> {
    if limit < 1 {
        bail!("--limit must be at least 1");
    }
    let filter = AuditFilter {
        since: since.map(parse_since).transpose()?,
        resource,
        limit,
    };
    let pool = conn.pg_migrated().await?;
    let rows = pgfence::list_audit(&pool, &filter).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        println!("no rejected writes");
        return Ok(ExitCode::SUCCESS);
    }
    let opt = |v: &Option<String>| v.as_deref().map(cell).unwrap_or_else(|| "-".into());
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.id.to_string(),
                r.at.format(&Rfc3339).unwrap_or_default(),
                r.operation.clone(),
                opt(&r.resource),
                opt(&r.table),
                opt(&r.key),
                r.presented.to_string(),
                r.current.map_or_else(|| "-".into(), |c| c.to_string()),
                opt(&r.holder),
            ]
        })
        .collect();
    print_table(
        &[
            "id",
            "at",
            "op",
            "resource",
            "table",
            "key",
            "presented",
            "current",
            "holder",
        ],
        &table,
    );
    Ok(ExitCode::SUCCESS)
}

/// Deletes audit rows older than `older_than`.
pub async fn prune(conn: &Conn, older_than: Duration) -> Result<ExitCode> {
    let cutoff = ago("--older-than", older_than)?;
    let pool = conn.pg_migrated().await?;
    let n = pgfence::prune_audit(&pool, cutoff).await?;
    println!(
        "pruned {n} audit row(s) older than {}",
        cutoff.format(&Rfc3339)?
    );
    Ok(ExitCode::SUCCESS)
}
