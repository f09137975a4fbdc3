//! Guarding and unguarding existing tables.

use crate::support;

use pgfence::{Error, table::TableName};
use support::TestDb;

fn t(name: &str) -> TableName {
    TableName::parse(name).unwrap()
}

#[tokio::test]
async fn guard_is_idempotent_and_unguard_removes_the_trigger() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE jobs (id int PRIMARY KEY, state text); INSERT INTO jobs VALUES (1, 'new');",
    )
    .await;
    assert!(pgfence::guard::guard(&db.pool, &t("jobs")).await.unwrap());
    assert!(
        !pgfence::guard::guard(&db.pool, &t("jobs")).await.unwrap(),
        "second guard is a no-op"
    );
    assert_eq!(
        pgfence::guard::guarded_tables(&db.pool).await.unwrap(),
        vec![t("jobs")]
    );
    let fence: i64 = sqlx::query_scalar("SELECT fence FROM jobs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(fence, 0);
    assert!(
        sqlx::query("UPDATE jobs SET state = 'x'")
            .execute(&db.pool)
            .await
            .is_err()
    );

    assert!(
        pgfence::guard::unguard(&db.pool, &t("jobs"), false)
            .await
            .unwrap()
    );
    assert!(
        !pgfence::guard::unguard(&db.pool, &t("jobs"), false)
            .await
            .unwrap()
    );
    assert!(
        pgfence::guard::guarded_tables(&db.pool)
            .await
            .unwrap()
            .is_empty()
    );
    sqlx::query("UPDATE jobs SET state = 'x'")
        .execute(&db.pool)
        .await
        .unwrap();
    assert!(
        pgfence::guard::unguard(&db.pool, &t("jobs"), true)
            .await
            .unwrap()
    );
    let cols: i64 = sqlx::query_scalar("SELECT count(*) FROM information_schema.columns WHERE table_name = 'jobs' AND column_name = 'fence'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(cols, 0);
}

#[tokio::test]
async fn wrong_fence_type_and_missing_tables_are_typed_errors() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE legacy (id int, fence text)").await;
    let err = pgfence::guard::guard(&db.pool, &t("legacy"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::FenceColumnType { ref found, .. } if found == "text"),
        "{err:?}"
    );
    let triggers: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_trigger WHERE tgname = 'pgfence_guard'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(triggers, 0, "nothing installed");

    let err = pgfence::guard::guard(&db.pool, &t("no_such_table"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::TableNotFound(_)), "{err:?}");
    // Names fold as SQL folds them: unquoted to lower case, quoted as written.
    db.exec("CREATE TABLE lower_only (id int)").await;
    assert!(matches!(
        pgfence::guard::guard(&db.pool, &t("\"LOWER_ONLY\"")).await,
        Err(Error::TableNotFound(_))
    ));
    assert!(
        pgfence::guard::guard(&db.pool, &t("LOWER_ONLY"))
            .await
            .unwrap()
    );
}

#[tokio::test]
async fn existing_nullable_bigint_fence_is_adopted() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE adopt (id int PRIMARY KEY, fence bigint); INSERT INTO adopt VALUES (1, NULL), (2, 5);").await;
    assert!(pgfence::guard::guard(&db.pool, &t("adopt")).await.unwrap());
    let fences: Vec<i64> = sqlx::query_scalar("SELECT fence FROM adopt ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(fences, vec![0, 5]);
}

#[tokio::test]
async fn migration_sql_guards_like_the_function() {
    let db = TestDb::new().await;
    db.exec(r#"CREATE TABLE "it's" (id int)"#).await;
    let sql =
        pgfence::guard::guard_migration_sql(&TableName::new("public", "it's").unwrap()).unwrap();
    assert!(
        sql.contains("SELECT pgfence.guard('public', 'it''s');"),
        "{sql}"
    );
    db.exec(&sql).await;
    assert_eq!(
        pgfence::guard::guarded_tables(&db.pool).await.unwrap(),
        vec![TableName::new("public", "it's").unwrap()]
    );
}
