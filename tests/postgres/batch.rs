//! Batch fenced writes: one statement per batch, one outcome per row, in input order.

use crate::support;

use pgfence::{
    Error, Fencing, Repository, Resource,
    repository::{BatchOutcome, MAX_BATCH_ROWS, RowOutcome},
    table::TableName,
};
use support::{Logs, TestDb, audit_count, token};

#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
struct Sku {
    sku: String,
    qty: i32,
}

pgfence::fenced_table!(Sku { table: "inventory", key: sku: String, columns: [qty] });

#[derive(Debug, Clone, PartialEq)]
struct Line {
    batch: i64,
    line: i32,
    amount: i64,
}

pgfence::fenced_table!(Line { table: "ledger_line", key: (batch: i64, line: i32), columns: [amount] });

fn sku(name: &str, qty: i32) -> Sku {
    Sku {
        sku: name.into(),
        qty,
    }
}

fn lease(n: i64) -> Fencing {
    Fencing::new(token(n))
        .holder(format!("job-{n}"))
        .resource(Resource::new("inventory:snapshot").unwrap())
}

async fn setup() -> (TestDb, Repository<Sku>) {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE inventory (sku text PRIMARY KEY, qty int NOT NULL);
         INSERT INTO inventory SELECT 'S-' || g, 0 FROM generate_series(1, 1000) g;",
    )
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("inventory").unwrap())
        .await
        .unwrap();
    let repo = Repository::new(db.pool.clone()).unwrap();
    (db, repo)
}

async fn qty(db: &TestDb, name: &str) -> Option<i32> {
    sqlx::query_scalar("SELECT qty FROM inventory WHERE sku = $1")
        .bind(name)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_mixed_batch_reports_applied_stale_and_missing_rows_in_input_order() {
    let (logs, _guard) = Logs::capture();
    let (db, repo) = setup().await;
    // A newer lease (5) already wrote S-2 and S-4.
    repo.update_many(&db.pool, &lease(5), &[sku("S-2", 50), sku("S-4", 50)])
        .await
        .unwrap();
    let out = repo
        .update_many(
            &db.pool,
            &lease(3),
            &[
                sku("S-1", 1),
                sku("S-2", 2),
                sku("nope", 3),
                sku("S-3", 4),
                sku("S-4", 5),
            ],
        )
        .await
        .unwrap();
    let stale = RowOutcome::Stale {
        current: 5,
        other_counter: false,
    };
    assert_eq!(
        out.rows,
        [
            RowOutcome::Applied,
            stale,
            RowOutcome::NotFound,
            RowOutcome::Applied,
            stale
        ]
    );
    let s = out.summary();
    assert_eq!((s.applied, s.stale, s.not_found), (2, 2, 1));
    assert_eq!(
        (
            qty(&db, "S-1").await,
            qty(&db, "S-2").await,
            qty(&db, "S-3").await
        ),
        (Some(1), Some(50), Some(4))
    );
    // One audit row and one WARN event per stale row, written by the explaining statement.
    assert_eq!(audit_count(&db.pool).await, 2);
    let keys: Vec<String> =
        sqlx::query_scalar("SELECT row_key FROM pgfence.audit ORDER BY row_key")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(keys, ["[\"S-2\"]", "[\"S-4\"]"]);
    let warns = logs.with(pgfence::audit::LOG_TARGET, "WARN");
    assert_eq!(warns.len(), 2);
    assert_eq!(warns[0]["fields"]["operation"], "update");
    assert_eq!(warns[0]["fields"]["presented"], 3);
    assert_eq!(warns[0]["fields"]["current"], 5);
}

#[tokio::test]
async fn one_lease_writes_its_batch_rows_again() {
    let (db, repo) = setup().await;
    let job = lease(7);
    let rows: Vec<Sku> = (1..=100).map(|i| sku(&format!("S-{i}"), i)).collect();
    for _ in 0..3 {
        assert!(
            repo.update_many(&db.pool, &job, &rows)
                .await
                .unwrap()
                .all_applied()
        );
    }
    // An older lease is fenced out of every row, a newer one is not.
    let out = repo.update_many(&db.pool, &lease(6), &rows).await.unwrap();
    assert_eq!(out.summary().stale, 100);
    assert!(
        repo.update_many(&db.pool, &lease(8), &rows)
            .await
            .unwrap()
            .all_applied()
    );
}

#[tokio::test]
async fn upsert_many_inserts_updates_and_respects_tombstones() {
    let (db, repo) = setup().await;
    repo.delete_many(&db.pool, &lease(5), &["S-9".to_owned()])
        .await
        .unwrap();
    repo.update_many(&db.pool, &lease(5), &[sku("S-8", 80)])
        .await
        .unwrap();
    let out = repo
        .upsert_many(
            &db.pool,
            &lease(4),
            &[sku("new-1", 1), sku("S-1", 1), sku("S-8", 1), sku("S-9", 1)],
        )
        .await
        .unwrap();
    let stale = RowOutcome::Stale {
        current: 5,
        other_counter: false,
    };
    assert_eq!(
        out.rows,
        [RowOutcome::Inserted, RowOutcome::Updated, stale, stale]
    );
    assert_eq!(qty(&db, "new-1").await, Some(1));
    assert_eq!(qty(&db, "S-8").await, Some(80));
    assert_eq!(
        qty(&db, "S-9").await,
        None,
        "a stale upsert cannot resurrect a deleted row"
    );
    let ops: Vec<String> = sqlx::query_scalar("SELECT operation FROM pgfence.audit")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(ops, ["upsert", "upsert"]);
}

#[tokio::test]
async fn delete_many_leaves_tombstones_and_reports_each_row() {
    let (db, repo) = setup().await;
    repo.update_many(&db.pool, &lease(9), &[sku("S-2", 2)])
        .await
        .unwrap();
    let out = repo
        .delete_many(
            &db.pool,
            &lease(8),
            &["S-1".to_owned(), "S-2".to_owned(), "gone".to_owned()],
        )
        .await
        .unwrap();
    assert_eq!(
        out.rows,
        [
            RowOutcome::Applied,
            RowOutcome::Stale {
                current: 9,
                other_counter: false
            },
            RowOutcome::NotFound
        ]
    );
    assert_eq!(qty(&db, "S-1").await, None);
    assert_eq!(qty(&db, "S-2").await, Some(2));
    let tombstones: i64 = sqlx::query_scalar("SELECT count(*) FROM pgfence.tombstone")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(tombstones, 1);
}

#[tokio::test]
async fn claim_many_returns_the_claimed_rows_and_fences_older_leases_out() {
    let (db, repo) = setup().await;
    repo.update_many(&db.pool, &lease(6), &[sku("S-3", 33)])
        .await
        .unwrap();
    let claimed = repo
        .claim_many::<_, Sku>(
            &db.pool,
            &lease(5),
            &["S-1".to_owned(), "S-3".to_owned(), "none".to_owned()],
        )
        .await
        .unwrap();
    assert_eq!(claimed.rows[0], Some(sku("S-1", 0)));
    assert_eq!(claimed.rows[1], None);
    assert_eq!(claimed.rows[2], None);
    assert_eq!(
        claimed.outcome.rows,
        [
            RowOutcome::Applied,
            RowOutcome::Stale {
                current: 6,
                other_counter: false
            },
            RowOutcome::NotFound
        ]
    );
    // The claim fenced S-1 against every older lease.
    let out = repo
        .update_many(&db.pool, &lease(4), &[sku("S-1", 9)])
        .await
        .unwrap();
    assert!(matches!(out.rows[0], RowOutcome::Stale { current: 5, .. }));
}

#[tokio::test]
async fn duplicate_keys_empty_and_oversized_batches() {
    let (db, repo) = setup().await;
    let err = repo
        .update_many(
            &db.pool,
            &lease(2),
            &[sku("S-1", 1), sku("S-2", 2), sku("S-1", 3)],
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Invalid(pgfence::error::InvalidInput::Batch { reason, .. }) if reason.contains("[\"S-1\"]")),
        "{err:?}"
    );
    assert_eq!(qty(&db, "S-2").await, Some(0), "nothing was written");
    let err = repo
        .claim_many::<_, Sku>(&db.pool, &lease(2), &["S-1".to_owned(), "S-1".to_owned()])
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Invalid(pgfence::error::InvalidInput::Batch { .. })
        ),
        "{err:?}"
    );

    assert_eq!(
        repo.update_many(&db.pool, &lease(2), &[]).await.unwrap(),
        BatchOutcome::default()
    );
    let too_many: Vec<Sku> = (0..=MAX_BATCH_ROWS)
        .map(|i| sku(&format!("x{i}"), 0))
        .collect();
    let err = repo
        .upsert_many(&db.pool, &lease(2), &too_many)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Invalid(pgfence::error::InvalidInput::Batch { .. })
        ),
        "{err:?}"
    );
    assert_eq!(audit_count(&db.pool).await, 0);
}

#[tokio::test]
async fn inside_a_transaction_the_audit_rows_outlive_a_rollback() {
    let (db, repo) = setup().await;
    repo.update_many(&db.pool, &lease(5), &[sku("S-1", 5)])
        .await
        .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let out = repo
        .update_many(&mut *tx, &lease(4), &[sku("S-1", 4), sku("S-2", 4)])
        .await
        .unwrap();
    assert_eq!(out.summary().applied, 1);
    tx.rollback().await.unwrap();
    assert_eq!(qty(&db, "S-2").await, Some(0), "rolled back");
    assert_eq!(
        audit_count(&db.pool).await,
        1,
        "the rejection's audit row survives"
    );
}

#[tokio::test]
async fn a_duplicate_token_is_a_row_outcome() {
    let (db, repo) = setup().await;
    let first = lease(6);
    let twin = Fencing::new(token(6))
        .holder("someone-else")
        .resource(Resource::new("inventory:snapshot").unwrap());
    repo.update_many(&db.pool, &first, &[sku("S-1", 1)])
        .await
        .unwrap();
    let out = repo
        .update_many(&db.pool, &twin, &[sku("S-1", 2), sku("S-2", 2)])
        .await
        .unwrap();
    assert_eq!(out.rows, [RowOutcome::DuplicateToken, RowOutcome::Applied]);
    assert_eq!(audit_count(&db.pool).await, 1);
}

#[tokio::test]
async fn composite_keys_batch_too() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE ledger_line (batch bigint, line int, amount bigint NOT NULL, PRIMARY KEY (batch, line));",
    )
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("ledger_line").unwrap())
        .await
        .unwrap();
    let repo = Repository::<Line>::new(db.pool.clone()).unwrap();
    let lines: Vec<Line> = (1..=50)
        .map(|line| Line {
            batch: 42,
            line,
            amount: i64::from(line) * 10,
        })
        .collect();
    let out = repo.upsert_many(&db.pool, &lease(3), &lines).await.unwrap();
    assert_eq!(out.summary().inserted, 50);
    let out = repo
        .delete_many(&db.pool, &lease(2), &[(42, 1), (42, 2)])
        .await
        .unwrap();
    assert_eq!(out.summary().stale, 2);
    let out = repo
        .delete_many(&db.pool, &lease(3), &[(42, 1), (42, 99)])
        .await
        .unwrap();
    assert_eq!(out.rows, [RowOutcome::Applied, RowOutcome::NotFound]);
    let sum: i64 = sqlx::query_scalar("SELECT sum(amount)::bigint FROM ledger_line")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(sum, (2..=50).map(|l| l * 10).sum::<i64>());
}

#[tokio::test]
async fn a_thousand_rows_in_one_call() {
    let (db, repo) = setup().await;
    let rows: Vec<Sku> = (1..=1000).map(|i| sku(&format!("S-{i}"), 7)).collect();
    let out = repo.update_many(&db.pool, &lease(2), &rows).await.unwrap();
    assert_eq!(out.summary().applied, 1000);
    let total: i64 = sqlx::query_scalar("SELECT sum(qty)::bigint FROM inventory")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(total, 7000);
}
