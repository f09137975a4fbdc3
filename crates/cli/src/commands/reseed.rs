//! `pgfence reseed`: raise a resource's Redis counter after a failover.

// Printing the result is the command's job.
#![allow(clippy::print_stdout)]

use std::process::ExitCode;

use anyhow::{Result, bail};
use serde_json::json;

use crate::cli::Conn;
use crate::util;
use crate::util::outln;

/// Raises `resource`'s counter to `floor`, or to Postgres's high-water mark without one.
pub async fn reseed(
    conn: &Conn,
    resource: &str,
    floor: Option<i64>,
    json: bool,
) -> Result<ExitCode> {
    let resource = util::resource(resource)?;
    match floor {
        Some(f) if f < 0 => bail!("--floor must not be negative"),
        // The next token would be out of range: every acquire would fail.
        Some(f) if f >= pgfence::token::MAX_TOKEN => {
            bail!(
                "--floor must be below {} (the largest token)",
                pgfence::token::MAX_TOKEN
            )
        }
        _ => {}
    }
    let issuer = conn.issuer().await?;
    if !issuer.kind().can_reseed() {
        // etcd / ZooKeeper: tokens are revisions / zxids, which never go backwards.
        let counter = issuer.status(&resource).await?.counter;
        if json {
            outln!(
                "{}",
                json!({"resource": resource.as_str(), "issuer": issuer.kind().name(), "reseeded": false, "counter": counter})
            )?;
        } else {
            outln!(
                "{resource}: nothing to reseed: the {} issuer's tokens never go backwards (current revision {counter})",
                issuer.kind()
            )?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let (source, floor) = match floor {
        Some(f) => ("--floor", f),
        None => {
            let mut session = conn.session_migrated().await?;
            // Under the issuer's key prefix's names (the default prefix's are the plain ones).
            let named = issuer.fencing_resource(&resource)?;
            let floor = pgfence::admin::counter_floor(session.conn(), &named).await?;
            session.commit().await?;
            ("postgres high-water mark", floor)
        }
    };
    let before = issuer.status(&resource).await?.counter;
    let after = issuer.raise_floor(&resource, floor).await?;
    if json {
        outln!(
            "{}",
            json!({"resource": resource.as_str(), "floor": floor, "before": before, "after": after})
        )?;
    } else if after > before {
        outln!(
            "{resource}: counter raised from {before} to {after} ({source} {floor}); next token {}",
            after + 1
        )?;
    } else {
        outln!("{resource}: counter {before} already at or above {source} {floor}; unchanged")?;
    }
    Ok(ExitCode::SUCCESS)
}
