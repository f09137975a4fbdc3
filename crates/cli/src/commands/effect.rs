//! `pgfence effect`: the effect ledger for shell jobs under `pgfence run` — record a call
//! before making it (and get its idempotency key), record its outcome after.

// Printing the result is the command's job.
#![allow(clippy::print_stdout)]

use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use pgfence::{Effects, FenceToken, Lease, Resource, effect::EffectOutcome};
use serde_json::json;

use crate::cli::{Conn, EffectLease};
use crate::util::outln;
use crate::util::{self, cell};

/// Exit code of `effect begin` when a holder already recorded the call's outcome: do not call.
pub const ALREADY_RECORDED: u8 = 3;

/// `name` as `pgfence effect` and `pgfence lock` take it: a resource, or its PostgreSQL name
/// under a key prefix (`PGFENCE_RESOURCE` of `pgfence run --key-prefix P`: `P{R`); the
/// resource and the key prefix its leases are fenced under (the name's, else
/// `--key-prefix`'s, else the default).
pub fn named_resource(conn: &Conn, name: &str) -> Result<(Resource, String)> {
    let named = match Resource::parse_fenced(name) {
        Ok(named) => named,
        // Not a name at all: the usual message about a bad resource name.
        Err(_) => util::resource(name)?,
    };
    let given = conn.key_prefix()?;
    match (named.key_prefix(), given) {
        (Some(own), Some(given)) if own != given => bail!(
            "{:?} is resource {:?} under key prefix {own:?}, not under --key-prefix / PGFENCE_KEY_PREFIX {given:?}",
            cell(name),
            cell(named.without_key_prefix().as_str()),
        ),
        (Some(own), _) => Ok((named.without_key_prefix(), own.to_owned())),
        (None, given) => Ok((
            named,
            given
                .unwrap_or(pgfence::issuer::DEFAULT_KEY_PREFIX)
                .to_owned(),
        )),
    }
}

fn lease(conn: &Conn, args: &EffectLease) -> Result<Lease> {
    let (resource, prefix) = named_resource(conn, &args.resource)?;
    let token: FenceToken = args
        .token
        .parse()
        .with_context(|| format!("bad token {:?}", cell(&args.token)))?;
    Ok(Lease::resume(resource, args.owner.as_str(), token).with_key_prefix(&prefix)?)
}

/// Records the effect and prints its idempotency key. Exit 0: make the call with the key;
/// exit 3: a holder already recorded its outcome (printed with `--json`), do not call.
pub async fn begin(
    conn: &Conn,
    lease_args: &EffectLease,
    work: &str,
    step: &str,
    json: bool,
) -> Result<ExitCode> {
    let lease = lease(conn, lease_args)?;
    let pool = conn.pg_migrated().await?;
    let effects = Effects::new(pool.clone());
    let effect = effects
        .begin(&pool, &lease, work, step)
        .await
        .map_err(|e| match e {
            e @ pgfence::Error::StaleToken { .. } => anyhow::Error::from(e)
                .context("a newer lease holds this work item: do not make the call"),
            e => e.into(),
        })?;
    if json {
        outln!(
            "{}",
            json!({
                "key": effect.idempotency_key(),
                "state": effect.recorded().map_or("pending", EffectOutcome::state),
                "outcome": effect.recorded().map(EffectOutcome::detail),
                "holders": effect.holders(),
            })
        )?;
    } else {
        outln!("{}", effect.idempotency_key())?;
    }
    Ok(if effect.recorded().is_some() {
        ExitCode::from(ALREADY_RECORDED)
    } else {
        ExitCode::SUCCESS
    })
}

/// Records the effect's outcome (`--outcome`: JSON, or any text, stored as a JSON string).
pub async fn finish(
    conn: &Conn,
    lease_args: &EffectLease,
    work: &str,
    step: &str,
    outcome: &str,
    failed: bool,
) -> Result<ExitCode> {
    let lease = lease(conn, lease_args)?;
    let detail = serde_json::from_str(outcome).unwrap_or_else(|_| json!(outcome));
    let outcome = if failed {
        EffectOutcome::Failed(detail)
    } else {
        EffectOutcome::Succeeded(detail)
    };
    let pool = conn.pg_migrated().await?;
    Effects::new(pool.clone())
        .finish_step(&pool, &lease, work, step, outcome)
        .await?;
    Ok(ExitCode::SUCCESS)
}

/// Prints an effect as recorded (exit 2 when no lease recorded it).
pub async fn status(
    conn: &Conn,
    resource: &str,
    work: &str,
    step: &str,
    json: bool,
) -> Result<ExitCode> {
    let (resource, prefix) = named_resource(conn, resource)?;
    let resource = resource.in_key_prefix(&prefix)?;
    let pool = conn.pg_migrated().await?;
    let record = Effects::new(pool.clone())
        .status(&pool, &resource, work, step)
        .await?;
    match (&record, json) {
        (_, true) => outln!("{}", serde_json::to_string(&record)?)?,
        (Some(r), false) => outln!(
            "{work} {step}: {} key={} token={} holders={}{}",
            r.state,
            r.idempotency_key,
            r.token,
            r.holders,
            r.outcome
                .as_ref()
                .map(|o| format!(" outcome={}", cell(&o.to_string())))
                .unwrap_or_default()
        )?,
        (None, false) => outln!("{work} {step}: not recorded")?,
    }
    Ok(if record.is_some() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}
