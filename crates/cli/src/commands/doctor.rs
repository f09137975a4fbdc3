//! `pgfence doctor`: checks the setup and exits non-zero when anything but information was
//! found (see [`pgfence::admin::doctor`] for the checks).

// Printing the findings is the command's job.
#![allow(clippy::print_stdout)]

use std::process::ExitCode;

use anyhow::Result;
use pgfence::admin::{DoctorOptions, Finding, FindingKind, Severity};
use serde_json::json;

use crate::cli::{Conn, DoctorArgs};
use crate::connect::Session;
use crate::util::outln;
use crate::util::{self, cell};

/// Exit code when doctor found a problem (a warning or an error).
const FINDINGS: u8 = 1;

/// Runs the checks; one line per finding (or one JSON object), exit 0 when clean, 1 when
/// any finding is a problem ([`Finding::is_problem`]: a warning or an error, but not a check
/// the connected role may not make).
pub async fn doctor(conn: &Conn, args: &DoctorArgs) -> Result<ExitCode> {
    conn.key_prefix()?;
    let pool = conn.pg().await?;
    let mut options = DoctorOptions::default().scan_tables(!args.no_scan);
    if let Some(retention) = args.audit_retention {
        options = options.audit_retention(retention);
    }
    let resources = args
        .resources
        .iter()
        .map(|r| util::resource(r))
        .collect::<Result<Vec<_>>>()?;

    let mut early = Vec::new();
    let issuer = match conn.issuer_url() {
        Ok(_) if !args.no_redis => match conn.issuer().await {
            Ok(issuer) => Some(issuer),
            Err(e) => {
                early.push(issuer_finding(&e));
                None
            }
        },
        _ => None,
    };
    // With an issuer, doctor names each resource under the issuer's key prefix; without one,
    // under the prefix given here.
    let resources = match (conn.key_prefix()?, &issuer) {
        (Some(prefix), None) => resources
            .iter()
            .map(|r| r.in_key_prefix(prefix))
            .collect::<pgfence::Result<Vec<_>>>()?,
        _ => resources,
    };
    options = options.resources(resources);
    if args.ack_failover {
        let mut session = Session::begin(&pool).await?;
        let who = format!("pgfence doctor --ack-failover ({})", whoami());
        let n = pgfence::admin::acknowledge_failover(session.conn(), &who).await?;
        session.commit().await?;
        eprintln!("pgfence: acknowledged {n} failover(s) of the database");
    }
    // One read-only transaction: behind a transaction-mode pooler nothing is left behind.
    let mut session = Session::begin(&pool).await?;
    let mut findings = pgfence::admin::doctor(session.conn(), issuer.as_deref(), &options).await?;
    session.commit().await?;
    findings.splice(0..0, early);
    // Without an issuer, doctor reports the counters it could not compare; the Redis error
    // above already says why.
    if findings.iter().any(|f| {
        matches!(
            f.kind,
            FindingKind::RedisUnavailable | FindingKind::InvalidIssuerUrl
        )
    }) {
        findings.retain(|f| f.kind != FindingKind::CountersNotChecked || f.object != "redis");
    }
    let problems = findings.iter().filter(|f| f.is_problem()).count();

    if args.json {
        outln!(
            "{}",
            json!({"ok": problems == 0, "problems": problems, "findings": findings})
        )?;
    } else {
        for f in &findings {
            let severity = match f.severity {
                Severity::Error => "error",
                Severity::Warning => "warning",
                Severity::Info => "info",
            };
            let kind = serde_json::to_value(f.kind)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            let fix = f
                .suggestion
                .as_deref()
                .map(|s| format!(" (fix: {})", cell(s)))
                .unwrap_or_default();
            outln!(
                "{severity:<7} {kind:<22} {}: {}{fix}",
                cell(&f.object),
                cell(&f.message)
            )?;
        }
        let skipped = findings
            .iter()
            .filter(|f| f.kind == FindingKind::NotPermitted)
            .count();
        let skipped = if skipped == 0 {
            String::new()
        } else {
            format!(
                " ({skipped} check(s) not made: not permitted to this role; run doctor as the owner of schema pgfence for the full report)"
            )
        };
        if problems == 0 {
            outln!("ok: no problems found{skipped}")?;
        } else {
            outln!("{problems} problem(s) found{skipped}")?;
        }
    }
    Ok(if problems == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(FINDINGS)
    })
}

/// The finding for an issuer doctor could not connect to: a URL that did not parse
/// ([`FindingKind::InvalidIssuerUrl`]: nothing was tried), or a server that did not answer.
fn issuer_finding(e: &anyhow::Error) -> Finding {
    let invalid = e
        .downcast_ref::<pgfence::Error>()
        .is_some_and(|e| e.kind() == pgfence::error::ErrorKind::Invalid);
    let (kind, suggestion) = if invalid {
        (
            FindingKind::InvalidIssuerUrl,
            "correct the URL (--issuer-url / PGFENCE_ISSUER_URL, else --redis-url / REDIS_URL), or pass --no-redis",
        )
    } else {
        (
            FindingKind::RedisUnavailable,
            "check the issuer URL and that the server is up, or pass --no-redis",
        )
    };
    Finding {
        severity: Severity::Error,
        kind,
        object: "redis".to_owned(),
        message: util::one_line(e),
        suggestion: Some(suggestion.to_owned()),
    }
}

/// Who acknowledges: the OS user, when the environment says.
fn whoami() -> String {
    std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown user".to_owned())
}
