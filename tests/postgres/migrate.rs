//! Migrations: idempotent, safe concurrently, and harmless to an existing database.

use crate::support;

use support::TestDb;

#[tokio::test]
async fn second_run_is_a_no_op() {
    let db = TestDb::empty().await;
    let first = pgfence::migrate(&db.pool).await.unwrap();
    assert_eq!(
        first.iter().map(|m| m.version).collect::<Vec<_>>(),
        vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    );
    assert!(pgfence::migrate(&db.pool).await.unwrap().is_empty());
    let status = pgfence::migration_status(&db.pool).await.unwrap();
    assert!(status.iter().all(|m| m.applied_on.is_some()));
}

#[tokio::test]
async fn status_before_migrating_lists_pending() {
    let db = TestDb::empty().await;
    let status = pgfence::migration_status(&db.pool).await.unwrap();
    assert!(!status.is_empty() && status.iter().all(|m| m.applied_on.is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_runs_all_succeed_and_one_applies() {
    let db = TestDb::empty().await;
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let pool = db.pool.clone();
            tokio::spawn(async move { pgfence::migrate(&pool).await })
        })
        .collect();
    let mut applied = 0;
    for run in runs {
        applied += run
            .await
            .unwrap()
            .expect("every concurrent run succeeds")
            .len();
    }
    assert_eq!(applied, 11, "exactly one run applies V1 to V11");
}

/// A user's populated database with its own refinery history: only pgfence's schema appears.
#[tokio::test]
async fn existing_database_is_untouched() {
    let db = TestDb::empty().await;
    db.exec(
        "CREATE TABLE refinery_schema_history (version int4 PRIMARY KEY, name varchar(255), applied_on varchar(255), checksum varchar(255));
         INSERT INTO refinery_schema_history VALUES (1, 'users', '2024-01-01T00:00:00Z', '123'), (2, 'orders', '2024-01-02T00:00:00Z', '456');
         CREATE TABLE orders (id bigserial PRIMARY KEY, total bigint NOT NULL);
         INSERT INTO orders (total) SELECT g FROM generate_series(1, 1000) g;",
    )
    .await;
    let snapshot = || async {
        let history: Vec<(i32, String)> =
            sqlx::query_as("SELECT version, name FROM refinery_schema_history ORDER BY 1")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        let orders: (i64, i64) = sqlx::query_as("SELECT count(*), sum(total)::bigint FROM orders")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let columns: Vec<String> = sqlx::query_scalar(
            "SELECT table_name || '.' || column_name FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        (history, orders, columns)
    };
    let before = snapshot().await;
    pgfence::migrate(&db.pool).await.unwrap();
    assert_eq!(snapshot().await, before);
    let ours: i64 = sqlx::query_scalar("SELECT count(*) FROM pgfence.refinery_schema_history")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(ours, 11);

    // Guarding adds only the column and the trigger.
    pgfence::guard(&db.pool, &pgfence::TableName::parse("orders").unwrap())
        .await
        .unwrap();
    let (history, orders, columns) = snapshot().await;
    assert_eq!((history, orders), (before.0, before.1));
    assert_eq!(columns.len(), before.2.len() + 1);
    assert!(columns.contains(&"orders.fence".to_owned()));
}

/// Inside the caller's transaction, migrate pins its own search path only while it runs: the
/// caller's (transaction-local) setting is what the transaction has afterwards, whether the
/// schema was migrated by this call or already current.
#[tokio::test]
async fn migrate_in_a_transaction_gives_the_search_path_back() {
    let db = TestDb::empty().await;
    for round in 0..2 {
        let mut tx = db.pool.begin().await.unwrap();
        sqlx::raw_sql("SET LOCAL search_path = public, pg_catalog")
            .execute(&mut *tx)
            .await
            .unwrap();
        let applied = pgfence::migrate(&mut *tx).await.unwrap();
        assert_eq!(applied.is_empty(), round == 1, "round {round}");
        let path: String = sqlx::query_scalar("SELECT current_setting('search_path')")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(path, "public, pg_catalog", "round {round}");
        tx.commit().await.unwrap();
    }
}
