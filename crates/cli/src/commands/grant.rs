//! `pgfence grant`: an application role's privileges on pgfence's schema.

// Printing the result is the command's job.
#![allow(clippy::print_stdout)]

use std::process::ExitCode;

use anyhow::Result;

use crate::cli::Conn;
use crate::connect::Session;
use crate::util::outln;
use crate::util::{self, cell};

/// Grants `role` what an application needs on the `pgfence` schema (after revoking everything
/// else it had there, schema `CREATE` included), and prints the grants. Refuses `PUBLIC`.
/// With `idle_bound`, also sets the role's default `idle_in_transaction_session_timeout` in
/// this database (`0s`: removes it), in the same transaction.
pub async fn grant(
    conn: &Conn,
    role: &str,
    idle_bound: Option<std::time::Duration>,
) -> Result<ExitCode> {
    let role = util::role(role)?;
    let pool = conn.pg_migrated().await?;
    let granted = async {
        let mut session = Session::begin(&pool).await?;
        pgfence::admin::grant(session.conn(), &role).await?;
        if let Some(bound) = idle_bound {
            let bound = (!bound.is_zero()).then_some(bound);
            pgfence::admin::bound_idle_transactions(session.conn(), &role, bound).await?;
        }
        session.commit().await
    }
    .await;
    if let Err(e) = granted {
        return Err(
            super::needs_owner(&pool, "pgfence grant", "is a deploy-time command", e).await,
        );
    }
    outln!(
        "granted {} an application's privileges on pgfence (after revoking any others):",
        cell(&role.quoted())
    )?;
    // The statements that granted, one per privilege, as run.
    let sql = pgfence::admin::grant_sql(&role);
    let mut statement = String::new();
    for line in sql.lines().filter(|l| !l.starts_with("--")) {
        statement.push_str(line.trim());
        statement.push(' ');
        if line.trim_end().ends_with(';') {
            if statement.starts_with("GRANT") {
                outln!("  {}", cell(statement.trim_end()))?;
            }
            statement.clear();
        }
    }
    match idle_bound {
        Some(bound) if bound.is_zero() => outln!(
            "  removed {}'s idle_in_transaction_session_timeout in this database (the server's default applies)",
            cell(&role.quoted())
        )?,
        Some(bound) => outln!(
            "  {}'s transactions in this database end after {} ms idle (idle_in_transaction_session_timeout)",
            cell(&role.quoted()),
            bound.as_millis()
        )?,
        None => {}
    }
    Ok(ExitCode::SUCCESS)
}
