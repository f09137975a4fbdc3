//! Failovers of the database nobody acknowledged.

use sqlx::PgConnection;

use sqlx::{Acquire, Postgres};

use super::{Finding, FindingKind, Severity, may, not_permitted};
use crate::Result;

/// Failover check: records the database's timeline (so a promotion shows even before any
/// lease wrote through it) and reports every timeline nobody acknowledged.
pub(super) async fn failover(pool: &mut PgConnection, findings: &mut Vec<Finding>) -> Result<()> {
    let object = "database timeline";
    let may_note: bool = sqlx::query_scalar(
        "SELECT pg_catalog.has_function_privilege('pgfence.note_timeline()', 'EXECUTE')",
    )
    .fetch_one(&mut *pool)
    .await?;
    if !may_note {
        findings.push(not_permitted(
            object,
            "a failover of the database was",
            "EXECUTE on pgfence.note_timeline() (`pgfence grant ROLE` gives it)",
        ));
        return Ok(());
    }
    let (now, previous, unacknowledged): (i64, Option<i64>, bool) = sqlx::query_as(
        "SELECT current_timeline, previous_timeline, unacknowledged FROM pgfence.note_timeline()",
    )
    .fetch_one(&mut *pool)
    .await?;
    if !unacknowledged {
        return Ok(());
    }
    let fix = "leases that wrote before the promotion are fenced out (FencedByFailover) and new \
               leases write as usual; with asynchronous replication check what the promotion \
               lost (commits the old primary acknowledged after the standby's last replay: the \
               old primary's WAL, the jobs that ran then), then run `pgfence doctor --ack-failover`";
    if !may(pool, "timeline_history", "SELECT").await? {
        findings.push(
            Finding::new(Severity::Error, FindingKind::FailedOver, format!("{object} {now}"))
                .says(format!(
                    "the database failed over: it is on timeline {now}{}, and the promotion was not acknowledged",
                    previous.map(|p| format!(" (pgfence saw timeline {p} before)")).unwrap_or_default()
                ))
                .fix(fix),
        );
        return Ok(());
    }
    let rows: Vec<(i64, time::OffsetDateTime, Option<i64>)> = sqlx::query_as(
        "SELECT h.timeline, h.first_seen,
                (SELECT pg_catalog.max(o.timeline) FROM pgfence.timeline_history o
                  WHERE o.timeline OPERATOR(pg_catalog.<) h.timeline)
           FROM pgfence.timeline_history h
          WHERE h.acknowledged_at IS NULL ORDER BY h.timeline",
    )
    .fetch_all(&mut *pool)
    .await?;
    for (timeline, first_seen, before) in rows {
        let seen = first_seen
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default();
        findings.push(
            Finding::new(
                Severity::Error,
                FindingKind::FailedOver,
                format!("{object} {timeline}"),
            )
            .says(format!(
                "the database failed over to timeline {timeline}{} (first seen by pgfence at {seen}), and nobody acknowledged it",
                before
                    .map(|b| format!(" from timeline {b}"))
                    .unwrap_or_default()
            ))
            .fix(fix),
        );
    }
    Ok(())
}

/// Acknowledges every failover `doctor` reports ([`FindingKind::FailedOver`]): marks the
/// database's timelines as checked by `by`. Returns how many were acknowledged. Run it as the
/// owner of schema pgfence, once what the promotion lost has been looked at. Fencing does not
/// depend on it: leases bound to an older timeline stay fenced out.
///
/// # Errors
/// [`Error::Backend`](crate::Error::Backend) (a role other than the owner is refused).
pub async fn acknowledge_failover<'c, A>(conn: A, by: &str) -> Result<i32>
where
    A: Acquire<'c, Database = Postgres>,
{
    let mut conn = conn.acquire().await?;
    let n: i32 = sqlx::query_scalar("SELECT pgfence.acknowledge_failover($1)")
        .bind(by)
        .fetch_one(&mut *conn)
        .await
        .map_err(crate::error::deploy_time(
            "pgfence doctor --ack-failover",
            crate::error::SCHEMA_OWNER,
        ))?;
    Ok(n)
}
