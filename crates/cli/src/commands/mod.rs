//! One module per command; [`run()`] dispatches a parsed command line to it.

mod audit;
mod doctor;
mod effect;
mod emit;
mod grant;
mod guard;
mod lock;
mod migrate;
mod prefixes;
mod reseed;
pub mod run;
mod simulate;

use std::process::ExitCode;

use anyhow::Result;

use crate::cli::{AuditAction, Cli, Command, EffectAction, LockAction};

/// SQLSTATE `insufficient_privilege`.
const INSUFFICIENT_PRIVILEGE: &str = "42501";

/// The text of the `insufficient_privilege` error in `e`'s chain, if that is what `e` is.
fn permission_denied(e: &anyhow::Error) -> Option<String> {
    e.chain().find_map(|cause| {
        let db = match cause.downcast_ref::<pgfence::Error>() {
            // The library's own word for a refused deploy-time call.
            Some(
                pgfence::Error::NotPermitted { message, .. }
                | pgfence::Error::NotGranted { message },
            ) => return Some(message.clone()),
            Some(pgfence::Error::Backend(b)) => match b.as_sqlx() {
                Some(sqlx::Error::Database(db)) => db,
                _ => return None,
            },
            _ => match cause.downcast_ref::<sqlx::Error>() {
                Some(sqlx::Error::Database(db)) => db,
                _ => return None,
            },
        };
        (db.code().as_deref() == Some(INSUFFICIENT_PRIVILEGE)).then(|| db.message().to_owned())
    })
}

/// `e`, or, when PostgreSQL refused `command` for want of a privilege, an error that says
/// who may run it: `pgfence grant is a deploy-time command: run it as the owner of schema
/// pgfence (role "postgres"), not as role "app" (permission denied for ...)`. `what` says
/// what the command needs (`is a deploy-time command`, `reads the audit trail`). The roles are
/// read on a new transaction of `pool` (the refused one is rolled back by then).
pub(crate) async fn needs_owner(
    pool: &sqlx::PgPool,
    command: &str,
    what: &str,
    e: anyhow::Error,
) -> anyhow::Error {
    let Some(refusal) = permission_denied(&e) else {
        return e;
    };
    let roles = async {
        let mut session = crate::connect::Session::begin(pool).await?;
        let roles: (Option<String>, String) = sqlx::query_as(
            "SELECT (SELECT pg_catalog.pg_get_userbyid(n.nspowner)::pg_catalog.text
                       FROM pg_catalog.pg_namespace n
                      WHERE n.nspname OPERATOR(pg_catalog.=) 'pgfence'),
                    CURRENT_USER::pg_catalog.text",
        )
        .fetch_one(session.conn())
        .await?;
        session.commit().await?;
        anyhow::Ok(roles)
    }
    .await;
    let (owner, me) = match roles {
        Ok((owner, me)) => (owner, format!("role {:?}", crate::util::cell(&me))),
        Err(_) => (None, "the application role".to_owned()),
    };
    let owner = match owner {
        Some(owner) => format!(
            "role {:?}, the owner of schema pgfence",
            crate::util::cell(&owner)
        ),
        None => "the owner of schema pgfence (the role that ran `pgfence migrate`)".to_owned(),
    };
    anyhow::anyhow!("`{command}` {what}: run it as {owner}, not as {me} ({refusal})")
}

/// Runs the command, returning its exit code. Ctrl-C stops it with exit code 130, except for
/// `run`, which handles signals itself: it must release the lock after the command exits.
/// However the command ends (done, failed, interrupted), the PostgreSQL connections it opened
/// are closed before this returns ([`crate::connect::close_all`]).
pub async fn run(cli: Cli) -> Result<ExitCode> {
    let outcome = if matches!(cli.command, Command::Run(_)) {
        dispatch(cli).await
    } else {
        tokio::select! {
            outcome = dispatch(cli) => outcome,
            // Dropping the command's future drops any throwaway servers, which stops them.
            _ = tokio::signal::ctrl_c() => {
                eprintln!("pgfence: interrupted");
                Ok(ExitCode::from(130))
            }
        }
    };
    crate::connect::close_all().await;
    outcome
}

async fn dispatch(cli: Cli) -> Result<ExitCode> {
    let conn = cli.conn;
    match cli.command {
        Command::Migrate { status } => migrate::migrate(&conn, status).await,
        Command::Guard {
            tables,
            emit_migration,
            migration_format,
            observe,
            enforce: _,
            lock_timeout,
        } => {
            let mode = if observe {
                pgfence::guard::GuardMode::Observe
            } else {
                pgfence::guard::GuardMode::Enforce
            };
            guard::guard(
                &conn,
                &tables,
                emit_migration.as_deref(),
                migration_format,
                mode,
                lock_timeout,
            )
            .await
        }
        Command::Unguard {
            tables,
            drop_column,
            lock_timeout,
        } => guard::unguard(&conn, &tables, drop_column, lock_timeout).await,
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
        Command::Grant {
            role,
            idle_in_transaction_timeout,
        } => grant::grant(&conn, &role, idle_in_transaction_timeout).await,
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
