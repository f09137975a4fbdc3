//! `pgfence migrate` (then `guard` and raw SQL on the migrated schema), and the commands that
//! need the schema saying to migrate on a database without it.

use crate::common::Cli;
use crate::common::urls::{one_error, pgfence};
use crate::support;

use support::{TestDb, redis_url};

#[tokio::test]
async fn migrate_guard_and_raw_sql() {
    let db = TestDb::empty().await;
    let cli = Cli::new(&db).await;
    assert!(cli.ok(&["migrate"]).contains("applied V1__core"));
    assert!(cli.ok(&["migrate"]).contains("up to date"));
    let status = cli.ok(&["migrate", "--status"]);
    assert!(
        status.contains("V1") && !status.contains("pending"),
        "{status}"
    );

    db.exec("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint); INSERT INTO accounts VALUES (1, 100);").await;
    assert!(
        cli.ok(&["guard", "accounts"])
            .contains("guarded \"public\".\"accounts\"")
    );
    assert!(
        cli.ok(&["guard", "public.accounts"])
            .contains("already guarded")
    );
    assert!(
        cli.ok(&["tables", "--json"])
            .contains(r#""schema":"public","table":"accounts"}"#)
    );

    sqlx::query("UPDATE accounts SET balance = 5, fence = pgfence.lease_fence(3, 0)")
        .execute(&db.pool)
        .await
        .unwrap();
    let err = sqlx::query("UPDATE accounts SET balance = 0, fence = pgfence.lease_fence(2, 0)")
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert_eq!(
        err.as_database_error().unwrap().code().as_deref(),
        Some("PF001")
    );

    assert!(cli.ok(&["unguard", "accounts"]).contains("unguarded"));
    sqlx::query("UPDATE accounts SET balance = 0, fence = 2")
        .execute(&db.pool)
        .await
        .unwrap();
}

/// Commands on a database without pgfence's schema say to migrate.
#[tokio::test]
async fn unmigrated_database_suggests_migrate() {
    let db = TestDb::empty().await;
    db.exec("CREATE TABLE t (id int)").await;
    let redis = redis_url().await;
    for args in [
        &["guard", "t"][..],
        &["unguard", "t"],
        &["tables"],
        &["audit"],
        &["audit", "prune", "--older-than", "1d"],
        &["reseed", "r"],
    ] {
        let err = one_error(&pgfence(&db.url(), &redis, args));
        assert!(err.contains("run `pgfence migrate`"), "{args:?}: {err}");
    }
    let guarded: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_trigger WHERE NOT tgisinternal")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(guarded, 0);
}
