//! `pgfence::admin::doctor`: each problem it is meant to find, and a clean bill on a healthy setup.

use crate::support;

use std::time::Duration;

use pgfence::{
    admin::{DoctorOptions, Finding, FindingKind, Severity},
    guard::GuardMode,
    table::TableName,
    token::MAX_TOKEN,
};
use support::{TestDb, issuer, unique_resource};

fn t(name: &str) -> TableName {
    TableName::parse(name).unwrap()
}

/// A migrated database with one guarded, populated table `jobs`.
async fn healthy() -> TestDb {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE jobs (id int PRIMARY KEY, state text); INSERT INTO jobs VALUES (1, 'new'), (2, 'new');")
        .await;
    pgfence::guard::guard(&db.pool, &t("jobs")).await.unwrap();
    db
}

fn problems(findings: &[Finding]) -> Vec<&Finding> {
    findings.iter().filter(|f| f.is_problem()).collect()
}

fn kinds(findings: &[Finding]) -> Vec<FindingKind> {
    problems(findings).iter().map(|f| f.kind).collect()
}

async fn run(db: &TestDb, options: &DoctorOptions) -> Vec<Finding> {
    let issuer = issuer().await;
    pgfence::admin::doctor(&db.pool, Some(&issuer), options)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_healthy_setup_is_clean() {
    let db = healthy().await;
    // A lease checks a resource and writes a row: marks and counters agree.
    let issuer = issuer().await;
    let resource = unique_resource("doctor:healthy");
    let lease = issuer
        .acquire(&resource, Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    pgfence::Fence::new(db.pool.clone())
        .check(&db.pool, &resource, &lease)
        .await
        .unwrap();
    let findings = pgfence::admin::doctor(
        &db.pool,
        Some(&issuer),
        &DoctorOptions::default().audit_retention(Duration::from_secs(86_400)),
    )
    .await
    .unwrap();
    assert!(problems(&findings).is_empty(), "{findings:#?}");
    // The highest token per table is reported as information.
    assert!(
        findings
            .iter()
            .any(|f| f.kind == FindingKind::HighestToken && f.object == "\"public\".\"jobs\""),
        "{findings:#?}"
    );
    issuer.release(&lease).await.unwrap();

    // Observe mode is information, not a problem.
    pgfence::guard::guard_with(&db.pool, &t("jobs"), GuardMode::Observe)
        .await
        .unwrap();
    let findings = run(&db, &DoctorOptions::default()).await;
    assert!(problems(&findings).is_empty(), "{findings:#?}");
    assert!(findings.iter().any(|f| f.kind == FindingKind::ObserveMode));
}

#[tokio::test]
async fn schema_not_migrated_or_behind_or_ahead() {
    let db = TestDb::empty().await;
    let findings = run(&db, &DoctorOptions::default()).await;
    assert_eq!(kinds(&findings), vec![FindingKind::SchemaNotMigrated]);
    assert_eq!(findings[0].severity, Severity::Error);
    assert!(
        findings[0]
            .suggestion
            .as_deref()
            .unwrap()
            .contains("pgfence migrate")
    );

    pgfence::admin::migrate(&db.pool).await.unwrap();
    assert!(problems(&run(&db, &DoctorOptions::default()).await).is_empty());
    let last: i32 = sqlx::query_scalar("SELECT max(version) FROM pgfence.refinery_schema_history")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM pgfence.refinery_schema_history WHERE version = $1")
        .bind(last)
        .execute(&db.pool)
        .await
        .unwrap();
    let findings = run(&db, &DoctorOptions::default()).await;
    assert_eq!(
        kinds(&findings),
        vec![FindingKind::SchemaBehind],
        "{findings:#?}"
    );
    assert!(findings[0].message.contains(&format!("V{last}__")));

    db.exec(&format!(
        "INSERT INTO pgfence.refinery_schema_history (version, name, applied_on, checksum)
         SELECT {last}, 'x', '2024-01-01T00:00:00Z', '1' UNION ALL
         SELECT 999, 'from_the_future', '2030-01-01T00:00:00Z', '1'"
    ))
    .await;
    let findings = run(&db, &DoctorOptions::default()).await;
    assert_eq!(
        kinds(&findings),
        vec![FindingKind::SchemaAhead],
        "{findings:#?}"
    );
}

#[tokio::test]
async fn disabled_and_missing_triggers() {
    let db = healthy().await;
    db.exec("CREATE TABLE other (id int PRIMARY KEY)").await;
    pgfence::guard::guard(&db.pool, &t("other")).await.unwrap();

    db.exec("ALTER TABLE jobs DISABLE TRIGGER pgfence_guard")
        .await;
    let findings = run(&db, &DoctorOptions::default()).await;
    assert_eq!(
        kinds(&findings),
        vec![FindingKind::TriggerDisabled],
        "{findings:#?}"
    );
    assert_eq!(findings[0].object, "\"public\".\"jobs\"");
    let listed = pgfence::guard::guarded_tables_with_modes(&db.pool)
        .await
        .unwrap();
    assert!(
        !listed
            .iter()
            .find(|g| g.table == t("jobs"))
            .unwrap()
            .enabled
    );
    // guard re-enables it.
    assert!(pgfence::guard::guard(&db.pool, &t("jobs")).await.unwrap());
    assert!(problems(&run(&db, &DoctorOptions::default()).await).is_empty());

    db.exec("DROP TRIGGER pgfence_guard ON other").await;
    let findings = run(&db, &DoctorOptions::default()).await;
    assert_eq!(
        kinds(&findings),
        vec![FindingKind::TriggerMissing],
        "{findings:#?}"
    );
    assert_eq!(findings[0].object, "\"public\".\"other\"");
    // unguard means "no longer guarded": nothing missing any more.
    pgfence::guard::unguard(&db.pool, &t("other"), false)
        .await
        .unwrap();
    assert!(problems(&run(&db, &DoctorOptions::default()).await).is_empty());
}

#[tokio::test]
async fn nullable_or_mistyped_fence_columns() {
    let db = healthy().await;
    db.exec("ALTER TABLE jobs ALTER COLUMN fence DROP NOT NULL")
        .await;
    let findings = run(&db, &DoctorOptions::default()).await;
    assert_eq!(
        kinds(&findings),
        vec![FindingKind::FenceColumnNullable],
        "{findings:#?}"
    );
    db.exec("ALTER TABLE jobs DISABLE TRIGGER pgfence_guard; UPDATE jobs SET fence = NULL WHERE id = 2; ALTER TABLE jobs ENABLE TRIGGER pgfence_guard")
        .await;
    let found = kinds(&run(&db, &DoctorOptions::default()).await);
    assert!(found.contains(&FindingKind::FenceInvalid), "{found:?}");
    pgfence::guard::guard(&db.pool, &t("jobs")).await.unwrap();
    assert!(problems(&run(&db, &DoctorOptions::default()).await).is_empty());

    // A type change needs the trigger gone (it depends on the column).
    db.exec("DROP TRIGGER pgfence_guard ON jobs; ALTER TABLE jobs ALTER COLUMN fence TYPE numeric")
        .await;
    let found = kinds(&run(&db, &DoctorOptions::default()).await);
    assert!(found.contains(&FindingKind::FenceColumnType), "{found:?}");
    assert!(found.contains(&FindingKind::TriggerMissing), "{found:?}");
}

/// Takes and releases a lease of a new resource from `issuer`, then has Postgres see a token 50
/// above it (the counter went backwards): the resource, that mark, and doctor's findings with
/// `issuer`.
async fn counter_behind(
    db: &TestDb,
    issuer: &dyn pgfence::TokenIssuer,
    name: &str,
) -> (pgfence::Resource, i64, Vec<Finding>) {
    let resource = unique_resource(name);
    let lease = issuer
        .acquire(&resource, Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    issuer.release(&lease).await.unwrap();
    let mark = lease.token().get() + 50;
    sqlx::query("SELECT pgfence.check($1, $2, 0)")
        .bind(resource.as_str())
        .bind(mark)
        .execute(&db.pool)
        .await
        .unwrap();
    let findings = pgfence::admin::doctor(&db.pool, Some(issuer), &DoctorOptions::default())
        .await
        .unwrap();
    (resource, mark, findings)
}

#[tokio::test]
async fn a_counter_below_the_mark_suggests_reseed() {
    let db = healthy().await;
    let issuer = issuer().await;
    let (resource, mark, findings) = counter_behind(&db, &issuer, "doctor:behind").await;
    let below: Vec<_> = problems(&findings)
        .into_iter()
        .filter(|f| f.kind == FindingKind::CounterBelowMark)
        .collect();
    assert_eq!(below.len(), 1, "{findings:#?}");
    assert_eq!(below[0].object, format!("resource {resource}"));
    assert!(
        below[0]
            .suggestion
            .as_deref()
            .unwrap()
            .contains("pgfence reseed")
    );
    assert!(below[0].message.contains(&mark.to_string()));
    assert!(
        below[0].message.contains("the Redis counter"),
        "{}",
        below[0].message
    );

    // Without Redis the counters are not compared (information only).
    let findings = pgfence::admin::doctor(&db.pool, None, &DoctorOptions::default())
        .await
        .unwrap();
    assert!(problems(&findings).is_empty(), "{findings:#?}");
    assert!(
        findings
            .iter()
            .any(|f| f.kind == FindingKind::CountersNotChecked)
    );

    issuer.reseed(&db.pool, &resource).await.unwrap();
    let findings = run(&db, &DoctorOptions::default()).await;
    assert!(problems(&findings).is_empty(), "{findings:#?}");

    // A table written with a token above every counter doctor read.
    sqlx::query("UPDATE jobs SET fence = pgfence.next_fence(fence, $1, 0) WHERE id = 1")
        .bind(mark + 1000)
        .execute(&db.pool)
        .await
        .unwrap();
    let found = kinds(&run(&db, &DoctorOptions::default()).await);
    assert_eq!(found, vec![FindingKind::TokenAboveCounters]);
}

#[tokio::test]
async fn old_audit_rows_against_a_retention() {
    let db = healthy().await;
    db.exec(
        "INSERT INTO pgfence.audit (at, resource, presented, current, operation)
         VALUES (now() - interval '40 days', 'r', 1, 2, 'check'), (now(), 'r', 1, 2, 'check')",
    )
    .await;
    let thirty = DoctorOptions::default().audit_retention(Duration::from_secs(30 * 86_400));
    let findings = run(&db, &thirty).await;
    assert_eq!(
        kinds(&findings),
        vec![FindingKind::AuditRetention],
        "{findings:#?}"
    );
    assert_eq!(findings[0].severity, Severity::Warning);
    assert!(
        findings[0]
            .message
            .starts_with("1 audit row(s) are older than 30d")
    );
    assert!(
        findings[0]
            .suggestion
            .as_deref()
            .unwrap()
            .contains("pgfence audit prune --older-than 30d")
    );
    let sixty = DoctorOptions::default().audit_retention(Duration::from_secs(60 * 86_400));
    assert!(problems(&run(&db, &sixty).await).is_empty());
    // Not checked unless asked.
    assert!(problems(&run(&db, &DoctorOptions::default()).await).is_empty());
}

#[tokio::test]
async fn huge_and_invalid_fences() {
    let db = healthy().await;
    sqlx::query("UPDATE jobs SET fence = pgfence.next_fence(fence, $1, 0) WHERE id = 1")
        .bind(MAX_TOKEN - 10)
        .execute(&db.pool)
        .await
        .unwrap();
    let options = DoctorOptions::default();
    let found = kinds(
        &pgfence::admin::doctor(&db.pool, None, &options)
            .await
            .unwrap(),
    );
    assert_eq!(found, vec![FindingKind::FenceNearLimit]);
    // Not scanned when told not to.
    let quick = DoctorOptions::default().scan_tables(false);
    assert!(
        problems(
            &pgfence::admin::doctor(&db.pool, None, &quick)
                .await
                .unwrap()
        )
        .is_empty()
    );
    // A smaller margin accepts it.
    let narrow = DoctorOptions::default().limit_margin(5);
    assert!(
        problems(
            &pgfence::admin::doctor(&db.pool, None, &narrow)
                .await
                .unwrap()
        )
        .is_empty()
    );

    // A negative fence decodes to no token (inserts are not guarded).
    db.exec("INSERT INTO jobs VALUES (3, 'forged', -5)").await;
    let found = kinds(
        &pgfence::admin::doctor(&db.pool, None, &options)
            .await
            .unwrap(),
    );
    assert!(found.contains(&FindingKind::FenceInvalid), "{found:?}");

    // A resource mark near the limit.
    let db = healthy().await;
    sqlx::query("SELECT pgfence.check('doctor:huge', $1, 0)")
        .bind(MAX_TOKEN - 1)
        .execute(&db.pool)
        .await
        .unwrap();
    let findings = pgfence::admin::doctor(&db.pool, None, &options)
        .await
        .unwrap();
    assert_eq!(kinds(&findings), vec![FindingKind::FenceNearLimit]);
    assert_eq!(problems(&findings)[0].object, "resource doctor:huge");
}

/// A made-up first token on a fresh row or a new resource is not bounded by the poisoning
/// bound (there is no current token to measure the jump from), so it gets through — the
/// issue's exact statements — and locks every real lease out; doctor reports both as errors,
/// each with its repair.
#[tokio::test]
async fn a_made_up_first_token_is_a_doctor_error_with_its_repair() {
    let db = healthy().await;
    let updated = sqlx::query("UPDATE jobs SET fence = 549755813887::bigint << 24 WHERE id = 1")
        .execute(&db.pool)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(updated, 1, "a fresh row's first token is not bounded");
    sqlx::query("SELECT pgfence.check('new', 549755813887, 0)")
        .execute(&db.pool)
        .await
        .unwrap();
    let findings = pgfence::admin::doctor(&db.pool, None, &DoctorOptions::default())
        .await
        .unwrap();
    let near: Vec<&Finding> = findings
        .iter()
        .filter(|f| f.kind == FindingKind::FenceNearLimit)
        .collect();
    assert_eq!(near.len(), 2, "{findings:?}");
    for f in &near {
        assert_eq!(f.severity, pgfence::admin::Severity::Error, "{f:?}");
        assert!(f.is_problem());
        assert!(
            f.message.contains("no issuer's counter gets there"),
            "{f:?}"
        );
    }
    let fixes: Vec<&str> = near
        .iter()
        .filter_map(|f| f.suggestion.as_deref())
        .collect();
    assert!(
        fixes
            .iter()
            .any(|f| f.contains("DISABLE TRIGGER pgfence_guard")),
        "{fixes:?}"
    );
    assert!(
        fixes
            .iter()
            .any(|f| f.contains("pgfence.unpoison_resource('new', N)")),
        "{fixes:?}"
    );
}

/// The finding names the issuer whose counter went backwards: the PostgreSQL issuer's counter
/// is not "the Redis counter".
#[tokio::test]
async fn a_postgres_issuers_counter_below_the_mark_is_named_as_such() {
    let db = healthy().await;
    let issuer = pgfence::issuer::PgIssuer::new(db.pool.clone());
    let (_, _, findings) = counter_behind(&db, &issuer, "doctor:pg-behind").await;
    let below: Vec<_> = problems(&findings)
        .into_iter()
        .filter(|f| f.kind == FindingKind::CounterBelowMark)
        .collect();
    assert_eq!(below.len(), 1, "{findings:#?}");
    let message = &below[0].message;
    assert!(message.contains("PostgreSQL issuer's counter"), "{message}");
    assert!(!message.contains("Redis"), "{message}");
}

/// With idle expiry on, a resource whose counter expired is reported as expired (info), not
/// as a counter that went backwards, and doctor reports what the issuer keeps: its counters,
/// how many are idle and expiring, and the idle expiry.
#[tokio::test]
async fn an_expired_counter_is_not_a_counter_gone_backwards_and_state_is_reported() {
    let db = healthy().await;
    let prefix = format!("dr{:08x}", rand::random::<u32>());
    let issuer = issuer()
        .await
        .with_key_prefix(&prefix)
        .unwrap()
        .with_idle_expiry(Duration::from_secs(1))
        .unwrap();
    let held = unique_resource("doctor:idle-held");
    let lease = issuer
        .acquire(&held, Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    let resource = unique_resource("doctor:idle");
    let fenced = resource.in_key_prefix(&prefix).unwrap();
    let gone = issuer
        .acquire(&resource, Duration::from_secs(1))
        .await
        .unwrap()
        .unwrap();
    sqlx::query("SELECT pgfence.check($1, $2, 0)")
        .bind(fenced.as_str())
        .bind(gone.token().get())
        .execute(&db.pool)
        .await
        .unwrap();
    issuer.release(&gone).await.unwrap();
    let state = |findings: &[Finding]| {
        findings
            .iter()
            .find(|f| f.kind == FindingKind::IssuerState)
            .map(|f| f.message.clone())
            .unwrap()
    };
    let findings = pgfence::admin::doctor(&db.pool, Some(&issuer), &DoctorOptions::default())
        .await
        .unwrap();
    let said = state(&findings);
    assert!(
        said.contains("2 counter(s), 1 of them idle") && said.contains("2 of them expiring"),
        "{said}"
    );
    assert!(said.contains("idle expiry 1s"), "{said}");
    // The lease's TTL plus the idle expiry, and Redis's expiry cycle.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let findings = pgfence::admin::doctor(&db.pool, Some(&issuer), &DoctorOptions::default())
        .await
        .unwrap();
    assert!(
        !findings
            .iter()
            .any(|f| f.kind == FindingKind::CounterBelowMark),
        "{findings:?}"
    );
    let expired: Vec<_> = findings
        .iter()
        .filter(|f| f.kind == FindingKind::CounterExpired)
        .collect();
    assert_eq!(expired.len(), 1, "{findings:?}");
    assert_eq!(expired[0].severity, Severity::Info);
    assert!(expired[0].object.contains(resource.as_str()), "{expired:?}");
    let said = state(&findings);
    assert!(
        said.contains("1 counter(s), 0 of them idle"),
        "the held lease's: {said}"
    );
    issuer.release(&lease).await.unwrap();
}
