//! Audit rows older than the retention.

use sqlx::PgConnection;

use std::time::Duration;

use super::{DoctorOptions, Finding, FindingKind, Severity, may, not_permitted};
use crate::Result;

/// Audit retention check.
pub(super) async fn audit(
    pool: &mut PgConnection,
    options: &DoctorOptions,
    findings: &mut Vec<Finding>,
) -> Result<()> {
    let Some(retention) = options.audit_retention else {
        return Ok(());
    };
    if !may(pool, "audit", "SELECT").await? {
        findings.push(not_permitted(
            "pgfence.audit",
            "audit retention was",
            "SELECT on pgfence.audit",
        ));
        return Ok(());
    }
    let (count, oldest): (i64, Option<time::OffsetDateTime>) = sqlx::query_as(
        "SELECT pg_catalog.count(*), pg_catalog.min(at) FROM pgfence.audit
          WHERE at OPERATOR(pg_catalog.<) (pg_catalog.now()
                OPERATOR(pg_catalog.-) pg_catalog.make_interval(secs => $1))",
    )
    .bind(retention.as_secs_f64())
    .fetch_one(&mut *pool)
    .await?;
    if count > 0 {
        let age = fmt_retention(retention);
        let oldest = oldest
            .and_then(|t| {
                t.format(&time::format_description::well_known::Rfc3339)
                    .ok()
            })
            .map(|t| format!(" (oldest {t})"))
            .unwrap_or_default();
        findings.push(
            Finding::new(
                Severity::Warning,
                FindingKind::AuditRetention,
                "pgfence.audit",
            )
            .says(format!("{count} audit row(s) are older than {age}{oldest}"))
            .fix(format!("run `pgfence audit prune --older-than {age}`")),
        );
    }
    Ok(())
}

/// `30d`, `12h`, `5m`, `90s`: the largest whole unit.
pub(super) fn fmt_retention(d: Duration) -> String {
    let s = d.as_secs().max(1);
    for (unit, secs) in [("d", 86_400), ("h", 3_600), ("m", 60)] {
        if s.is_multiple_of(secs) {
            return format!("{}{unit}", s / secs);
        }
    }
    format!("{s}s")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_is_printed_in_its_largest_unit() {
        assert_eq!(fmt_retention(Duration::from_secs(30 * 86_400)), "30d");
        assert_eq!(fmt_retention(Duration::from_secs(7_200)), "2h");
        assert_eq!(fmt_retention(Duration::from_secs(90)), "90s");
        assert_eq!(fmt_retention(Duration::from_millis(10)), "1s");
    }
}
