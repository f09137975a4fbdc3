//! `pgfence lock`: acquire, release and inspect a lock by hand.

// Printing the result is the command's job.
#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use pgfence::{FenceToken, Lease, issuer::ReleaseOutcome};
use serde_json::json;

use crate::cli::Conn;
use crate::connect::take_lock;
use crate::util::outln;
use crate::util::{cell, fmt_duration};

/// `name` as a lock's resource: a resource, or its PostgreSQL name under this command's key
/// prefix (`PGFENCE_RESOURCE` of `pgfence run --key-prefix P`: `P{R`).
fn lock_resource(conn: &Conn, name: &str) -> Result<pgfence::Resource> {
    let (resource, prefix) = super::effect::named_resource(conn, name)?;
    if prefix
        != conn
            .key_prefix()?
            .unwrap_or(pgfence::issuer::DEFAULT_KEY_PREFIX)
    {
        anyhow::bail!(
            "{:?} is resource {:?} under key prefix {prefix:?}: pass --key-prefix {prefix}",
            cell(name),
            cell(resource.as_str())
        );
    }
    Ok(resource)
}

/// Takes a lock and prints its token and owner id (and how to release it).
pub async fn acquire(
    conn: &Conn,
    resource: &str,
    ttl: Duration,
    wait: Option<Duration>,
    json: bool,
) -> Result<ExitCode> {
    let resource = lock_resource(conn, resource)?;
    pgfence::issuer::limits::check_ttl(ttl)?;
    let issuer = conn.lock_issuer().await?;
    if issuer.kind() == pgfence::issuer::IssuerKind::ZooKeeper {
        // Its lock node is ephemeral: it would be gone as soon as this command exits.
        anyhow::bail!(
            "a ZooKeeper lock lives only as long as the process that took it, so `lock acquire` cannot hand one to a later command: run the work under `pgfence run --resource {resource} -- CMD` instead"
        );
    }
    let lease = take_lock(&*issuer, &resource, ttl, wait).await?;
    if json {
        outln!(
            "{}",
            json!({"resource": resource.as_str(), "token": lease.token().get(), "owner": lease.owner(), "ttl_ms": ttl.as_millis()})
        )?;
    } else {
        outln!(
            "acquired {} token={} owner={} ttl={}",
            resource,
            lease.token(),
            lease.owner(),
            fmt_duration(ttl)
        )?;
        outln!(
            "release: pgfence lock release {} --owner {} --token {}",
            resource,
            lease.owner(),
            lease.token()
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Releases a lock taken by `lock acquire`; exit code 2 if it was no longer held.
pub async fn release(
    conn: &Conn,
    resource: &str,
    owner: &str,
    token: &str,
    json: bool,
) -> Result<ExitCode> {
    let resource = lock_resource(conn, resource)?;
    let token: FenceToken = token
        .parse()
        .with_context(|| format!("bad token {:?}", cell(token)))?;
    let issuer = conn.issuer().await?;
    let lease = Lease::resume(resource.clone(), owner, token);
    let outcome = issuer.release(&lease).await?;
    if json {
        outln!(
            "{}",
            json!({"resource": resource.as_str(), "result": outcome.as_str()})
        )?;
    } else {
        match outcome {
            ReleaseOutcome::Released => outln!("released {resource}")?,
            ReleaseOutcome::AlreadyExpired => outln!("{resource}: the lock had already expired")?,
            ReleaseOutcome::TakenByOther => {
                outln!("{resource}: another holder has the lock; left it alone")?;
            }
        }
    }
    Ok(if outcome.is_released() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}

/// Prints a lock's holder, token, TTL and counter, under the key prefix in use (named when it
/// is not the default). A lock that is free with no counter under that prefix but has one
/// under another prefix is said so on stderr, naming the `--key-prefix` to pass.
pub async fn status(conn: &Conn, resource: &str, json: bool) -> Result<ExitCode> {
    let resource = lock_resource(conn, resource)?;
    let issuer = conn.issuer().await?;
    let status = issuer.status(&resource).await?;
    let prefix = issuer.key_prefix().to_owned();
    if status.owner.is_none() && status.counter == 0 {
        let elsewhere =
            super::prefixes::counters_elsewhere(conn.issuer_url()?, &resource, &prefix).await;
        if let Some((other, _)) = elsewhere.first() {
            let all: Vec<String> = elsewhere
                .iter()
                .map(|(p, c)| format!("{} (counter={c})", cell(p)))
                .collect();
            crate::util::warn_later(format!(
                "{resource} has no lock or counter under key prefix {}, but has a counter under key prefix {}: {} to see the lock of the service that uses it",
                cell(&prefix),
                all.join(", "),
                super::prefixes::how_to_select(other),
            ));
        }
    }
    if json {
        let mut value = serde_json::to_value(&status)?;
        value["key_prefix"] = json!(prefix);
        outln!("{value}")?;
        return Ok(ExitCode::SUCCESS);
    }
    let name = if prefix == pgfence::issuer::DEFAULT_KEY_PREFIX {
        resource.to_string()
    } else {
        format!("{resource} (key prefix {})", cell(&prefix))
    };
    if let (Some(owner), Some(token)) = (&status.owner, status.token) {
        let expires = match status.ttl_ms {
            Some(ms) if ms >= 0 => format!("expires in {ms}ms"),
            _ => "no expiry (the key was set without a TTL)".to_owned(),
        };
        outln!(
            "{name}: held by {} token={token} {expires}; counter={}",
            cell(owner),
            status.counter
        )?;
    } else {
        outln!("{name}: free; counter={}", status.counter)?;
    }
    Ok(ExitCode::SUCCESS)
}
