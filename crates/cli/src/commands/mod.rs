//! One module per command; [`run()`] dispatches a parsed command line to it.

mod audit;
mod doctor;
mod effect;
mod grant;
mod guard;
mod lock;
mod migrate;
mod reseed;
pub mod run;
mod simulate;

use std::process::ExitCode;

use anyhow::Result;

use crate::cli::{AuditAction, Cli, Command, EffectAction, LockAction};

/// Runs the command, returning its exit code. Ctrl-C stops it with exit code 130, except for
/// `run`, which handles signals itself: it must release the lock after the command exits.
pub async fn run(cli: Cli) -> Result<ExitCode> {
    if matches!(cli.command, Command::Run(_)) {
        return dispatch(cli).await;
    }
    tokio::select! {
        outcome = dispatch(cli) => outcome,
        // Dropping the command's future drops any throwaway servers, which stops them.
        _ = tokio::signal::ctrl_c() => {
            eprintln!("pgfence: interrupted");
            Ok(ExitCode::from(130))
        }
    }
}

async fn dispatch(cli: Cli) -> Result<ExitCode> {
    let conn = cli.conn;
    match cli.command {
        Command::Migrate { status } => migrate::migrate(&conn, status).await,
        Command::Guard {
            table,
            emit_migration,
            observe,
            enforce: _,
            lock_timeout,
        } => {
            let mode = if observe {
                pgfence::guard::GuardMode::Observe
            } else {
                pgfence::guard::GuardMode::Enforce
            };
            guard::guard(&conn, &table, emit_migration.as_deref(), mode, lock_timeout).await
        }
        Command::Unguard {
            table,
            drop_column,
            lock_timeout,
        } => guard::unguard(&conn, &table, drop_column, lock_timeout).await,
        Command::Tables { json } => guard::tables(&conn, json).await,
        Command::Audit(args) => match args.action {
            Some(AuditAction::Prune { older_than }) => audit::prune(&conn, older_than).await,
            None => {
                audit::list(
                    &conn,
                    args.since.as_deref(),
                    args.resource,
                    args.limit,
                    args.json,
                    args.follow,
                )
                .await
            }
        },
        Command::Lock { action } => match action {
            LockAction::Acquire {
                resource,
                ttl,
                wait,
                json,
            } => lock::acquire(&conn, &resource, ttl, wait, json).await,
            LockAction::Release {
                resource,
                owner,
                token,
                json,
            } => lock::release(&conn, &resource, &owner, &token, json).await,
            LockAction::Status { resource, json } => lock::status(&conn, &resource, json).await,
        },
        Command::Run(args) => {
            run::run(
                &conn,
                &args.resource,
                args.ttl,
                args.wait,
                args.on_lease_lost,
                &args.command,
            )
            .await
        }
        Command::Reseed {
            resource,
            floor,
            json,
        } => reseed::reseed(&conn, &resource, floor, json).await,
        Command::Grant { role } => grant::grant(&conn, &role).await,
        Command::Effect { action } => match action {
            EffectAction::Begin {
                work,
                step,
                lease,
                json,
            } => effect::begin(&conn, &lease, &work, &step, json).await,
            EffectAction::Finish {
                work,
                step,
                lease,
                outcome,
                failed,
            } => effect::finish(&conn, &lease, &work, &step, &outcome, failed).await,
            EffectAction::Status {
                resource,
                work,
                step,
                json,
            } => effect::status(&conn, &resource, &work, &step, json).await,
        },
        Command::Simulate(args) => simulate::simulate(&conn, &args).await,
        Command::Doctor(args) => doctor::doctor(&conn, &args).await,
    }
}
