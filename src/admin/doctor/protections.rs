//! What is in force on this database, for the connected role.

use sqlx::PgConnection;

use super::{Finding, FindingKind, Severity, may, not_permitted};
use crate::Result;

/// What is in force on this database: the timeline check (off, and why, where the WAL
/// functions are not available), the guarded tables by mode, and the connected role.
pub(super) async fn protections(
    pool: &mut PgConnection,
    findings: &mut Vec<Finding>,
) -> Result<()> {
    let object = "database";
    let (readable, role, superuser, owner): (bool, String, bool, bool) = sqlx::query_as(
        "SELECT pg_catalog.has_function_privilege('pgfence.timeline()', 'EXECUTE')
                AND pg_catalog.has_schema_privilege('pgfence', 'USAGE'),
                CURRENT_USER::pg_catalog.text, r.rolsuper,
                pg_catalog.pg_has_role(n.nspowner, 'USAGE')
           FROM pg_catalog.pg_roles r, pg_catalog.pg_namespace n
          WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER
            AND n.nspname OPERATOR(pg_catalog.=) 'pgfence'",
    )
    .fetch_one(&mut *pool)
    .await?;
    if !readable {
        findings.push(not_permitted(
            object,
            "the protections in force were",
            "EXECUTE on pgfence.timeline() (`pgfence grant ROLE` gives it)",
        ));
        return Ok(());
    }
    let timeline: i64 = sqlx::query_scalar("SELECT pgfence.timeline()")
        .fetch_one(&mut *pool)
        .await?;
    let timeline_check = if timeline == 0 {
        let reason: Option<String> = if may(pool, "timeline_check", "SELECT").await? {
            sqlx::query_scalar("SELECT reason FROM pgfence.timeline_check")
                .fetch_optional(&mut *pool)
                .await?
                .flatten()
        } else {
            None
        };
        findings.push(
            Finding::new(Severity::Info, FindingKind::TimelineCheckOff, object)
                .says(format!(
                    "failover fencing by timeline is off for this database: {}. Not protected: a promotion of a standby that loses acknowledged commits (asynchronous replication) can put a fenced-out lease's fence back on a row, and that lease's next write is then admitted. Acceptable where a failover loses no acknowledged commit (Amazon Aurora's shared storage, synchronous replication with no async promotion); not for a self-managed primary with an asynchronous standby. Every other protection is in force",
                    reason.as_deref().unwrap_or("its WAL functions are not available (run doctor as the schema's owner for the reason)")
                ))
                .fix("where the WAL functions can be made available (Aurora: enable logical replication; elsewhere: GRANT EXECUTE ON FUNCTION pg_catalog.pg_current_wal_lsn(), pg_catalog.pg_walfile_name(pg_lsn) TO PUBLIC), then run SELECT pgfence.configure_timeline() as the schema's owner (docs/failover.md)"),
        );
        "off".to_owned()
    } else {
        format!("on (timeline {timeline})")
    };
    // Asked first: a refused read would abort the transaction doctor may run in.
    let listed = if may(pool, "guarded_tables", "SELECT").await? {
        crate::guard::guarded_tables_with_modes(&mut *pool)
            .await
            .ok()
    } else {
        None
    };
    let tables = match listed {
        Some(tables) => {
            let count = |f: &dyn Fn(&crate::guard::GuardedTable) -> bool| {
                tables.iter().filter(|t| f(t)).count()
            };
            format!(
                "{} guarded table(s): {} enforcing, {} observing, {} with the trigger disabled",
                tables.len(),
                count(&|t| t.enabled && t.mode == crate::guard::GuardMode::Enforce),
                count(&|t| t.enabled && t.mode == crate::guard::GuardMode::Observe),
                count(&|t| !t.enabled),
            )
        }
        None => "guarded tables not readable by this role".to_owned(),
    };
    let standing = if superuser {
        "a superuser"
    } else if owner {
        "the owner of schema pgfence (deploy time)"
    } else {
        "an application role (run time)"
    };
    findings.push(
        Finding::new(Severity::Info, FindingKind::Protections, object).says(format!(
            "timeline check {timeline_check}; {tables}; connected as {role}, {standing}"
        )),
    );
    Ok(())
}
