//! Where production PostgreSQL runs: a database owner who is not a superuser (RDS, Cloud SQL,
//! Azure, Supabase, Neon) deploys pgfence, and a server whose WAL functions are not available
//! (Amazon Aurora without logical replication; locally: EXECUTE on them revoked from PUBLIC)
//! installs and fences with the timeline check off.

use crate::support;

use pgfence::{
    Effects, Fence, Fencing, Repository, Resource, admin::FindingKind, guard::GuardMode,
    table::TableName,
};
use sqlx::PgPool;
use support::{Role, TestDb, token};

#[derive(Debug, Clone, sqlx::FromRow)]
struct Invoice {
    id: i64,
    status: String,
}
pgfence::fenced_table!(Invoice { table: "invoices", key: id: i64, columns: [status] });

/// A database owned by a role that is not a superuser, as a managed service hands it out;
/// with `wal_functions: false`, the WAL functions are not executable by PUBLIC there.
async fn managed(wal_functions: bool) -> (TestDb, Role, PgPool) {
    let db = TestDb::empty().await;
    let owner = Role::create(&db, "owner", "NOSUPERUSER NOCREATEROLE").await;
    db.exec(&format!(
        "ALTER DATABASE \"{}\" OWNER TO {}",
        db.name,
        owner.quoted()
    ))
    .await;
    if !wal_functions {
        db.exec(
            "REVOKE EXECUTE ON FUNCTION pg_catalog.pg_current_wal_lsn(),
                                        pg_catalog.pg_walfile_name(pg_catalog.pg_lsn) FROM PUBLIC",
        )
        .await;
    }
    let pool = owner.pool(&db).await;
    (db, owner, pool)
}

async fn timeline_check(pool: &PgPool) -> (bool, Option<String>) {
    sqlx::query_as("SELECT enabled, reason FROM pgfence.timeline_check")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The README's deploy sequence as the database's owner (not a superuser), on a server without
/// WAL functions, then the application role's run.
#[tokio::test]
async fn a_non_superuser_owner_deploys_and_the_app_fences_without_wal_functions() {
    let (db, _owner, owner_pool) = managed(false).await;

    // Deploy time, as the owner.
    assert!(
        !pgfence::admin::migrate(&owner_pool)
            .await
            .unwrap()
            .is_empty()
    );
    let (enabled, reason) = timeline_check(&owner_pool).await;
    assert!(!enabled);
    assert!(
        reason
            .as_deref()
            .is_some_and(|r| r.contains("pg_walfile_name") || r.contains("pg_current_wal_lsn")),
        "{reason:?}"
    );
    let timeline: i64 = sqlx::query_scalar("SELECT pgfence.timeline()")
        .fetch_one(&owner_pool)
        .await
        .unwrap();
    assert_eq!(timeline, 0, "the check is off: no WAL function runs");
    sqlx::raw_sql(
        "CREATE TABLE invoices (id bigint PRIMARY KEY, status text NOT NULL);
         INSERT INTO invoices SELECT g, 'open' FROM generate_series(1, 5) g;
         CREATE TABLE ledger (id bigint PRIMARY KEY, amount int NOT NULL);",
    )
    .execute(&owner_pool)
    .await
    .unwrap();
    let invoices = TableName::parse("invoices").unwrap();
    let ledger = TableName::parse("ledger").unwrap();
    pgfence::guard::guard_with(&owner_pool, &invoices, GuardMode::Observe)
        .await
        .unwrap();
    pgfence::guard::guard_with(&owner_pool, &invoices, GuardMode::Enforce)
        .await
        .unwrap();
    pgfence::guard::guard(&owner_pool, &ledger).await.unwrap();
    assert!(
        pgfence::guard::unguard(&owner_pool, &ledger, true)
            .await
            .unwrap()
    );
    let emitted = pgfence::guard::guard_migration_sql(&ledger).unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(emitted))
        .execute(&owner_pool)
        .await
        .unwrap();
    let app = Role::create(&db, "app", "").await;
    pgfence::admin::grant(&owner_pool, &app.ident())
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON invoices, ledger TO {}",
        app.quoted()
    )))
    .execute(&owner_pool)
    .await
    .unwrap();
    let admin_role = Role::create(&db, "refunds", "").await;
    pgfence::guard::allow_bypass(&owner_pool, &admin_role.name)
        .await
        .unwrap();
    // doctor says what is in force, and what the missing WAL functions leave out.
    let findings =
        pgfence::admin::doctor(&owner_pool, None, &pgfence::admin::DoctorOptions::default())
            .await
            .unwrap();
    let off = findings
        .iter()
        .find(|f| f.kind == FindingKind::TimelineCheckOff)
        .unwrap_or_else(|| panic!("{findings:?}"));
    assert!(
        off.message.contains("failover fencing by timeline is off"),
        "{off:?}"
    );
    assert!(off.message.contains("pg_walfile_name"), "{off:?}");
    assert!(off.message.contains("Aurora"), "{off:?}");
    assert!(
        off.suggestion
            .as_deref()
            .is_some_and(|s| s.contains("pgfence.configure_timeline()")),
        "{off:?}"
    );
    assert!(
        !off.is_problem(),
        "a platform's property, not a fault: {off:?}"
    );
    let summary = findings
        .iter()
        .find(|f| f.kind == FindingKind::Protections)
        .unwrap_or_else(|| panic!("{findings:?}"));
    assert!(
        summary.message.contains("timeline check off"),
        "{summary:?}"
    );
    assert!(summary.message.contains("2 enforcing"), "{summary:?}");
    assert!(
        summary.message.contains("owner of schema pgfence"),
        "{summary:?}"
    );
    assert!(findings.iter().all(|f| !f.is_problem()), "{findings:?}");
    pgfence::admin::acknowledge_failover(&owner_pool, "deploy")
        .await
        .unwrap();
    pgfence::audit::prune(&owner_pool, time::OffsetDateTime::now_utc())
        .await
        .unwrap();

    // Run time, as the application role: every write API works, and stale leases are
    // still refused.
    let pool = app.pool(&db).await;
    assert!(pgfence::admin::migrate(&pool).await.unwrap().is_empty());
    let repo = Repository::<Invoice>::new(pool.clone()).unwrap();
    let resource = Resource::new("billing:run").unwrap();
    let lease = |n: i64, holder: &str| {
        Fencing::new(token(n))
            .resource(resource.clone())
            .holder(holder)
    };
    let (old, new) = (lease(1, "old"), lease(2, "new"));
    let inv = |id: i64, status: &str| Invoice {
        id,
        status: status.into(),
    };
    repo.update(&pool, &old, &inv(1, "a")).await.unwrap();
    let claimed: Invoice = repo.claim(&pool, &new, &1).await.unwrap();
    assert_eq!(claimed.status, "a");
    repo.update(&pool, &new, &inv(1, "b")).await.unwrap();
    let err = repo
        .update(&pool, &old, &inv(1, "zombie"))
        .await
        .unwrap_err();
    support::assert_stale(&err, 1, 2);
    repo.upsert(&pool, &new, &inv(9, "new row")).await.unwrap();
    repo.delete(&pool, &new, &2).await.unwrap();
    let batch = repo
        .update_many(&pool, &new, &[inv(3, "c"), inv(4, "d")])
        .await
        .unwrap();
    assert!(batch.all_applied(), "{batch:?}");
    let fence = Fence::new(pool.clone());
    fence.check(&pool, &resource, &new).await.unwrap();
    let err = fence.check(&pool, &resource, &old).await.unwrap_err();
    support::assert_stale(&err, 1, 2);
    let effects = Effects::new(pool.clone());
    effects
        .begin(&pool, &new, "invoice:1", "charge")
        .await
        .unwrap();
    assert_eq!(
        new.timeline(),
        None,
        "leases stay unbound where the check is off"
    );

    // With the functions granted again, the owner turns the check on.
    db.exec(
        "GRANT EXECUTE ON FUNCTION pg_catalog.pg_current_wal_lsn(),
                                   pg_catalog.pg_walfile_name(pg_catalog.pg_lsn) TO PUBLIC",
    )
    .await;
    let on: bool = sqlx::query_scalar("SELECT pgfence.configure_timeline()")
        .fetch_one(&owner_pool)
        .await
        .unwrap();
    assert!(on);
    let timeline: i64 = sqlx::query_scalar("SELECT pgfence.timeline()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(timeline > 0);
}

/// The control: the same owner on a server with its WAL functions gets the timeline check.
#[tokio::test]
async fn with_wal_functions_the_timeline_check_is_on() {
    let (_db, _owner, owner_pool) = managed(true).await;
    pgfence::admin::migrate(&owner_pool).await.unwrap();
    assert_eq!(timeline_check(&owner_pool).await, (true, None));
    let findings =
        pgfence::admin::doctor(&owner_pool, None, &pgfence::admin::DoctorOptions::default())
            .await
            .unwrap();
    assert!(
        findings
            .iter()
            .all(|f| f.kind != FindingKind::TimelineCheckOff),
        "{findings:?}"
    );
    assert!(
        findings
            .iter()
            .any(|f| f.kind == FindingKind::Protections && f.message.contains("timeline check on")),
        "{findings:?}"
    );
    let timeline: i64 = sqlx::query_scalar("SELECT pgfence.timeline()")
        .fetch_one(&owner_pool)
        .await
        .unwrap();
    assert!(timeline > 0);
}
