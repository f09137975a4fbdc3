//! Whether pgfence's schema is there, and at this version.

use sqlx::PgConnection;

use super::{Finding, FindingKind, Severity, may, not_permitted};
use crate::Result;

/// The schema check; `true` when the other checks can run.
pub(super) async fn schema(pool: &mut PgConnection, findings: &mut Vec<Finding>) -> Result<bool> {
    let object = "schema pgfence";
    let (present, usage, versioned, role): (bool, Option<bool>, Option<bool>, String) = sqlx::query_as(
        "SELECT n.oid IS NOT NULL AND EXISTS (
                    SELECT FROM pg_catalog.pg_class c
                     WHERE c.relnamespace OPERATOR(pg_catalog.=) n.oid
                       AND c.relname OPERATOR(pg_catalog.=) 'refinery_schema_history'),
                CASE WHEN n.oid IS NOT NULL THEN pg_catalog.has_schema_privilege(n.oid, 'USAGE') END,
                CASE WHEN p.oid IS NOT NULL THEN pg_catalog.has_function_privilege(p.oid, 'EXECUTE') END,
                CURRENT_USER::pg_catalog.text
           FROM (SELECT) AS one
           LEFT JOIN pg_catalog.pg_namespace n ON n.nspname OPERATOR(pg_catalog.=) 'pgfence'
           LEFT JOIN pg_catalog.pg_proc p ON p.pronamespace OPERATOR(pg_catalog.=) n.oid
                AND p.proname OPERATOR(pg_catalog.=) 'schema_version'",
    )
    .fetch_one(&mut *pool)
    .await?;
    if !present {
        findings.push(
            Finding::new(Severity::Error, FindingKind::SchemaNotMigrated, object)
                .says("pgfence's schema is not migrated in this database (other checks skipped)")
                .fix("run `pgfence migrate` (or pgfence::admin::migrate)"),
        );
        return Ok(false);
    }
    if usage != Some(true) {
        // Not a check doctor may not make: this role cannot run pgfence at all.
        let role = crate::table::Ident::new(role.as_str())
            .map_or_else(|_| "ROLE".to_owned(), |r| r.quoted());
        findings.push(
            Finding::new(Severity::Error, FindingKind::NotGranted, object)
                .says(format!(
                    "the connected role {role} lacks pgfence's grants (no USAGE on schema pgfence): its fenced writes, claims and checks fail with \"permission denied for schema pgfence\" (other checks skipped)"
                ))
                .fix(format!(
                    "as the owner of schema pgfence, run `pgfence grant {role}` (pgfence::admin::grant) if the application connects as this role; otherwise run `pgfence doctor` as the owner for the full report"
                )),
        );
        return Ok(false);
    }
    if may(pool, "refinery_schema_history", "SELECT").await? {
        history(pool, findings).await
    } else {
        // The application role: the version is readable, the history is not.
        version_only(pool, versioned == Some(true), findings).await
    }
}

/// The schema's version as `pgfence.schema_version()` reports it, for a role that may not read
/// the migration history.
async fn version_only(
    pool: &mut PgConnection,
    versioned: bool,
    findings: &mut Vec<Finding>,
) -> Result<bool> {
    let object = "schema pgfence";
    if !versioned {
        findings.push(not_permitted(
            object,
            "which migrations are applied was",
            "SELECT on pgfence.refinery_schema_history (and the schema has no pgfence.schema_version(), added by V7: it is behind this version)",
        ));
        return Ok(false);
    }
    let (version, applied): (i32, i32) =
        sqlx::query_as("SELECT version, applied FROM pgfence.schema_version()")
            .fetch_one(&mut *pool)
            .await?;
    let latest = crate::admin::migrate::latest_version();
    if version > latest {
        findings.push(ahead(version, latest));
    } else if version < latest || i64::from(applied) < i64::from(latest) {
        findings.push(
            Finding::new(Severity::Error, FindingKind::SchemaBehind, object)
                .says(format!(
                    "pgfence's schema is behind: V{version} applied, this version ships V{latest} (other checks skipped)"
                ))
                .fix("run `pgfence migrate` as the schema's owner"),
        );
        return Ok(false);
    }
    Ok(true)
}

/// The schema's version from the migration history, for a role that may read it.
async fn history(pool: &mut PgConnection, findings: &mut Vec<Finding>) -> Result<bool> {
    let object = "schema pgfence";
    let status = match crate::admin::migration_status(&mut *pool).await {
        Err(e @ crate::Error::UnreleasedMigrations { .. }) => {
            findings.push(
                Finding::new(Severity::Error, FindingKind::SchemaBehind, object)
                    .says(format!("{e} (other checks skipped)"))
                    .fix("delete the unreleased build's history rows (V7 to V13) as the schema's owner, then run `pgfence migrate`"),
            );
            return Ok(false);
        }
        status => status?,
    };
    let pending: Vec<String> = status
        .iter()
        .filter(|m| m.applied_on.is_none())
        .map(|m| format!("V{}__{}", m.version, m.name))
        .collect();
    let known = status.iter().map(|m| m.version).max().unwrap_or(0);
    let applied: Option<i32> =
        sqlx::query_scalar("SELECT pg_catalog.max(version) FROM pgfence.refinery_schema_history")
            .fetch_one(&mut *pool)
            .await?;
    if let Some(applied) = applied.filter(|v| *v > known) {
        findings.push(ahead(applied, known));
    }
    if pending.is_empty() {
        return Ok(true);
    }
    findings.push(
        Finding::new(Severity::Error, FindingKind::SchemaBehind, object)
            .says(format!(
                "pgfence's schema is behind: {} not applied (other checks skipped)",
                pending.join(", ")
            ))
            .fix("run `pgfence migrate` (or pgfence::admin::migrate)"),
    );
    Ok(false)
}

/// The finding for a database migrated by a newer pgfence.
fn ahead(version: i32, known: i32) -> Finding {
    Finding::new(
        Severity::Warning,
        FindingKind::SchemaAhead,
        "schema pgfence",
    )
    .says(format!(
        "the database has pgfence migration V{version}, newer than this version knows (V{known})"
    ))
    .fix("upgrade this pgfence (library or CLI) to the version that migrated the database")
}
