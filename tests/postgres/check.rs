//! The transaction-scope check: holders of one resource are serialised inside their
//! transactions; an older token cannot commit work after a newer one has checked.

use crate::support;

use std::time::Duration;

use pgfence::{Error, Fence, Resource};
use support::{Logs, TestDb, audit_count, token};

async fn ledger(db: &TestDb) -> Vec<i64> {
    sqlx::query_scalar("SELECT token FROM ledger ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

async fn setup() -> (TestDb, Fence, Resource) {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE ledger (id bigserial PRIMARY KEY, token bigint NOT NULL)")
        .await;
    let fence = Fence::new(db.pool.clone());
    (db, fence, Resource::new("payments:batch:42").unwrap())
}

/// 42 checks first and holds its transaction open; 41 arrives later and is rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newer_first_then_older_is_rejected() {
    let (db, fence, res) = setup().await;
    let mut t42 = db.pool.begin().await.unwrap();
    fence.check(&mut *t42, &res, token(42)).await.unwrap();
    sqlx::query("INSERT INTO ledger (token) VALUES (42)")
        .execute(&mut *t42)
        .await
        .unwrap();

    // 41 blocks on 42's row lock; it must fail once 42 commits.
    let (pool, f, r) = (db.pool.clone(), fence.clone(), res.clone());
    let t41 = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        let outcome = f.check(&mut *tx, &r, token(41)).await;
        if outcome.is_ok() {
            sqlx::query("INSERT INTO ledger (token) VALUES (41)")
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        }
        outcome
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!t41.is_finished(), "41 must wait for 42's transaction");
    t42.commit().await.unwrap();
    let err = t41.await.unwrap().unwrap_err();
    support::assert_stale(&err, 41, 42);
    assert_eq!(ledger(&db).await, vec![42]);
    assert_eq!(fence.high_water(&res).await.unwrap(), 42);
    assert_eq!(audit_count(&db.pool).await, 1);
}

/// 41 checks first: 42 waits until 41's transaction ends, so 41's work commits before 42 has
/// checked — never after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn older_first_commits_before_newer_checks() {
    let (db, fence, res) = setup().await;
    let mut t41 = db.pool.begin().await.unwrap();
    fence.check(&mut *t41, &res, token(41)).await.unwrap();

    let (pool, f, r) = (db.pool.clone(), fence.clone(), res.clone());
    let t42 = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        f.check(&mut *tx, &r, token(42)).await.unwrap();
        sqlx::query("INSERT INTO ledger (token) VALUES (42)")
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !t42.is_finished(),
        "42's check must wait for 41's transaction"
    );
    sqlx::query("INSERT INTO ledger (token) VALUES (41)")
        .execute(&mut *t41)
        .await
        .unwrap();
    t41.commit().await.unwrap();
    t42.await.unwrap();
    assert_eq!(ledger(&db).await, vec![41, 42]);

    // 41 again, after 42: rejected, and its work rolls back with its transaction.
    let mut tx = db.pool.begin().await.unwrap();
    assert!(
        fence
            .check(&mut *tx, &res, token(41))
            .await
            .unwrap_err()
            .is_stale()
    );
    drop(tx);
    assert_eq!(ledger(&db).await, vec![41, 42]);
}

#[tokio::test]
async fn one_lease_checks_in_many_transactions() {
    let (db, fence, res) = setup().await;
    let lease = pgfence::Fencing::new(token(7)).holder("job-7");
    for _ in 0..5 {
        let mut tx = db.pool.begin().await.unwrap();
        fence.check(&mut *tx, &res, &lease).await.unwrap();
        tx.commit().await.unwrap();
    }
    assert_eq!(fence.high_water(&res).await.unwrap(), 7);
    // A newer lease checks once: the old one is out, in any later transaction.
    fence.check(&db.pool, &res, token(8)).await.unwrap();
    let err = fence.check(&db.pool, &res, &lease).await.unwrap_err();
    assert!(
        matches!(err, Error::StaleToken { presented: 7, current: 8, ref target, .. } if target.resource() == Some("payments:batch:42")),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_duplicate_token_is_its_own_error_audited_and_logged() {
    let (logs, _guard) = Logs::capture();
    let (db, fence, res) = setup().await;
    // Two leases that got token 7 (a counter that went backwards): different holders.
    let first = pgfence::Fencing::new(token(7)).holder("owner-a");
    let second = pgfence::Fencing::new(token(7)).holder("owner-b");
    assert_ne!(first.tag(), second.tag());
    fence.check(&db.pool, &res, &first).await.unwrap();
    let err = fence.check(&db.pool, &res, &second).await.unwrap_err();
    assert!(
        matches!(err, Error::DuplicateToken { token: 7, ref target } if target.resource() == Some("payments:batch:42")),
        "{err:?}"
    );
    assert!(err.is_duplicate() && !err.is_stale());
    let warns = logs.with(pgfence::audit::LOG_TARGET, "WARN");
    assert_eq!(warns.len(), 1);
    assert_eq!(warns[0]["fields"]["operation"], "check");
    assert_eq!(warns[0]["fields"]["resource"], "payments:batch:42");
    let entry = &pgfence::audit::list(&db.pool, &Default::default())
        .await
        .unwrap()[0];
    assert_eq!(
        (entry.presented, entry.current, entry.table.as_deref()),
        (7, Some(7), None)
    );
    // The first lease is unaffected.
    fence.check(&db.pool, &res, &first).await.unwrap();
}

#[tokio::test]
async fn sql_function_refuses_bad_tokens() {
    let (db, _, _) = setup().await;
    for (resource, t) in [("r", 0_i64), ("r", -5), ("", 1)] {
        let err = sqlx::query("SELECT pgfence.check($1, $2)")
            .bind(resource)
            .bind(t)
            .execute(&db.pool)
            .await
            .unwrap_err();
        assert_eq!(
            err.as_database_error().unwrap().code().as_deref(),
            Some("22023")
        );
    }
    let marks: i64 = sqlx::query_scalar("SELECT count(*) FROM pgfence.resource_fence")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(marks, 0);
}
