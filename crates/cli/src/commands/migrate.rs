//! `pgfence migrate`: apply pgfence's schema, or show which migrations are applied.

// Printing the result is the command's job.
#![allow(clippy::print_stdout)]

use std::process::ExitCode;

use anyhow::Result;
use time::format_description::well_known::Rfc3339;

use crate::cli::Conn;
use crate::connect::Session;
use crate::util::outln;
use crate::util::print_table;

/// Applies pending migrations (printing each), or with `status_only` prints the table of them.
pub async fn migrate(conn: &Conn, status_only: bool) -> Result<ExitCode> {
    let pool = conn.pg().await?;
    // One transaction: through a transaction-mode pooler nothing stays on the server
    // connection (no session lock, no setting, no prepared statement).
    let mut session = Session::begin(&pool).await?;
    if !status_only {
        let applied = pgfence::admin::migrate(session.conn()).await?;
        session.commit().await?;
        if applied.is_empty() {
            outln!("pgfence schema is up to date")?;
        }
        for m in &applied {
            outln!("applied V{}__{}", m.version, m.name)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let status = pgfence::admin::migration_status(session.conn()).await;
    session.commit().await?;
    let rows: Vec<Vec<String>> = status?
        .into_iter()
        .map(|m| {
            let when = m
                .applied_on
                .and_then(|t| t.format(&Rfc3339).ok())
                .unwrap_or_else(|| "pending".into());
            vec![format!("V{}", m.version), m.name, when]
        })
        .collect();
    print_table(&["version", "name", "applied"], &rows)?;
    Ok(ExitCode::SUCCESS)
}
