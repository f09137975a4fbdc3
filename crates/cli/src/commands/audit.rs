//! `pgfence audit`: list rejected writes, or prune old audit rows.

// Printing the result is the command's job.
#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use pgfence::audit::AuditFilter;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::cli::Conn;
use crate::connect::Session;
use crate::util::outln;
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
    match util::parse_duration(s) {
        Ok(d) => return ago("--since", d),
        // Digits first: meant as a duration, so say what is wrong with it as one.
        Err(e) if s.trim().starts_with(|c: char| c.is_ascii_digit()) && !s.contains('-') => {
            bail!("--since {:?}: {e}", cell(&util::shorten(s)))
        }
        Err(_) => {}
    }
    OffsetDateTime::parse(s, &Rfc3339).with_context(|| {
        format!(
            "--since {:?}: expected a duration (1h, 30m) or an RFC 3339 time",
            cell(&util::shorten(s))
        )
    })
}

/// Prints rejected writes (newest first) as a table or one JSON array; with `follow`, the
/// newest `limit` oldest first and then every new one as it is recorded, until interrupted.
pub async fn list(
    conn: &Conn,
    since: Option<&str>,
    resource: Option<String>,
    limit: i64,
    json: bool,
    follow: bool,
) -> Result<ExitCode> {
    if limit < 1 {
        bail!("--limit must be at least 1");
    }
    let mut filter = AuditFilter {
        since: since.map(parse_since).transpose()?,
        resource,
        limit,
        after_id: None,
    };
    let given = filter.resource.clone();
    // A prefix's leases are audited under its names for their resources.
    let prefix = conn
        .key_prefix()?
        .unwrap_or(pgfence::issuer::DEFAULT_KEY_PREFIX);
    filter = filter.in_key_prefix(prefix)?;
    let pool = conn.pg_migrated().await?;
    let mut rows = match list_rows(&pool, &filter).await {
        Ok(rows) => rows,
        Err(e) => {
            return Err(super::needs_owner(
                &pool,
                "pgfence audit",
                "reads pgfence.audit, which an application role may not",
                e,
            )
            .await);
        }
    };
    // A filter the rows of another key prefix would match: say which prefix to pass.
    if let Some(pattern) = given.as_deref().filter(|p| !p.is_empty()) {
        let mut session = Session::begin(&pool).await?;
        let elsewhere =
            super::prefixes::audit_rows_elsewhere(session.conn(), pattern, filter.since, prefix)
                .await?;
        session.commit().await?;
        if let Some((other, _)) = elsewhere.iter().next() {
            let counts: Vec<String> = elsewhere
                .iter()
                .map(|(p, n)| format!("{n} under key prefix {}", cell(p)))
                .collect();
            let found = if rows.is_empty() {
                "no rejected writes"
            } else {
                "only these rejected writes"
            };
            util::warn_later(format!(
                "{found} for {:?} under key prefix {}, but {} match it: {} to list them",
                cell(pattern),
                cell(prefix),
                counts.join(", "),
                super::prefixes::how_to_select(other)
            ));
        }
    }
    if follow {
        // It runs until interrupted: say now what was held back.
        util::flush_warnings();
        rows.reverse();
        loop {
            for r in &rows {
                print_follow_line(r, json)?;
            }
            if let Some(last) = rows.last() {
                filter.after_id = Some(last.id);
            } else if filter.after_id.is_none() {
                filter.after_id = Some(0);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            rows = list_rows(&pool, &filter).await?;
        }
    }
    if json {
        let rows: Vec<serde_json::Value> = rows.iter().map(json_row).collect::<Result<_>>()?;
        outln!("{}", serde_json::to_string_pretty(&rows)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        match &given {
            Some(pattern) => outln!(
                "no rejected writes for {:?} under key prefix {}",
                cell(pattern),
                cell(prefix)
            )?,
            None => outln!("no rejected writes")?,
        }
        return Ok(ExitCode::SUCCESS);
    }
    let opt = |v: &Option<String>| v.as_deref().map(cell).unwrap_or_else(|| "-".into());
    // The last column only when some row has an application_name or a reason.
    let with_details = rows.iter().any(|r| !details(r).is_empty());
    // Resources as their services wrote them, with a key prefix column when some row belongs
    // to a key prefix other than the default.
    let with_prefix = rows
        .iter()
        .any(|r| stored(r).is_some_and(|(p, _)| p != pgfence::issuer::DEFAULT_KEY_PREFIX));
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let (key_prefix, resource) = match stored(r) {
                Some((p, name)) => (cell(&p), cell(&name)),
                None => ("-".to_owned(), opt(&r.resource)),
            };
            let mut row = vec![
                r.id.to_string(),
                r.at.format(&Rfc3339).unwrap_or_default(),
                r.operation.clone(),
            ];
            if with_prefix {
                row.push(key_prefix);
            }
            row.extend([
                resource,
                opt(&r.table),
                opt(&r.key),
                r.presented.to_string(),
                r.current.map_or_else(|| "-".into(), |c| c.to_string()),
                opt(&r.holder),
            ]);
            if with_details {
                row.push(details(r));
            }
            row
        })
        .collect();
    let mut headers = vec!["id", "at", "op"];
    if with_prefix {
        headers.push("key prefix");
    }
    headers.extend(["resource", "table", "key", "presented", "current", "holder"]);
    if with_details {
        headers.push("details");
    }
    print_table(&headers, &table)?;
    Ok(ExitCode::SUCCESS)
}

/// A row's resource split into its key prefix and the resource as its service wrote it
/// (`nu4{recon:batch:14` → `nu4`, `recon:batch:14`); `None` without a resource or for a name
/// that is not a resource's.
fn stored(r: &pgfence::audit::AuditEntry) -> Option<(String, String)> {
    super::prefixes::split_stored(r.resource.as_deref()?)
}

/// A row as JSON: every column as stored (`resource` is the PostgreSQL name), plus
/// `key_prefix` and `name` (the resource as its service wrote it) when the row has a resource.
fn json_row(r: &pgfence::audit::AuditEntry) -> Result<serde_json::Value> {
    let mut value = serde_json::to_value(r)?;
    if let Some((prefix, name)) = stored(r) {
        value["key_prefix"] = serde_json::Value::String(prefix);
        value["name"] = serde_json::Value::String(name);
    }
    Ok(value)
}

/// One followed audit row: a JSON object, or one human line.
fn print_follow_line(r: &pgfence::audit::AuditEntry, json: bool) -> Result<()> {
    let line = if json {
        serde_json::to_string(&json_row(r)?)?
    } else {
        let opt = |v: &Option<String>| v.as_deref().map(cell).unwrap_or_else(|| "-".into());
        let details = details(r);
        let sep = if details.is_empty() { "" } else { " " };
        let resource = match stored(r) {
            Some((p, name)) if p != pgfence::issuer::DEFAULT_KEY_PREFIX => {
                format!("{} key_prefix={}", cell(&name), cell(&p))
            }
            Some((_, name)) => cell(&name),
            None => opt(&r.resource),
        };
        format!(
            "{} {} {} resource={} table={} key={} presented={} current={} holder={}{sep}{details}",
            r.id,
            r.at.format(&Rfc3339).unwrap_or_default(),
            r.operation,
            resource,
            opt(&r.table),
            opt(&r.key),
            r.presented,
            r.current.map_or_else(|| "-".into(), |c| c.to_string()),
            opt(&r.holder),
        )
    };
    outln!("{line}")
}

/// A row's `application_name` and `reason`, those that are recorded: `app="psql"
/// reason="hotfix"`, each quoted with quotes, backslashes and control characters escaped (a
/// writer chooses its `application_name`: a newline in it cannot start a line of its own, nor
/// a `reason=` in it pass for the reason). Empty when neither is recorded (or both are empty:
/// a client that sets no `application_name` records `''`).
fn details(r: &pgfence::audit::AuditEntry) -> String {
    [("app", &r.application_name), ("reason", &r.reason)]
        .into_iter()
        .filter_map(|(name, v)| {
            v.as_deref()
                .filter(|v| !v.is_empty())
                .map(|v| format!("{name}={v:?}"))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// One read of the audit table, in a [`Session`] of its own (each poll of `--follow` too).
async fn list_rows(
    pool: &sqlx::PgPool,
    filter: &AuditFilter,
) -> Result<Vec<pgfence::audit::AuditEntry>> {
    let mut session = Session::begin(pool).await?;
    let rows = pgfence::audit::list(session.conn(), filter).await?;
    session.commit().await?;
    Ok(rows)
}

/// Deletes audit rows older than `older_than`.
pub async fn prune(conn: &Conn, older_than: Duration) -> Result<ExitCode> {
    let cutoff = ago("--older-than", older_than)?;
    let pool = conn.pg_migrated().await?;
    let pruned = async {
        let mut session = Session::begin(&pool).await?;
        let n = pgfence::audit::prune(session.conn(), cutoff).await?;
        session.commit().await?;
        anyhow::Ok(n)
    }
    .await;
    let n = match pruned {
        Ok(n) => n,
        Err(e) => {
            return Err(super::needs_owner(
                &pool,
                "pgfence audit prune",
                "deletes from pgfence.audit, which only its owner may",
                e,
            )
            .await);
        }
    };
    outln!(
        "pruned {n} audit row(s) older than {}",
        cutoff.format(&Rfc3339)?
    )?;
    Ok(ExitCode::SUCCESS)
}
