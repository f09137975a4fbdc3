//! One refusal, one audit row, one log event — whatever path explains it (stale, duplicate,
//! sealed; the failover path is counted in `pg_failover`), whether the write ran in its own
//! transaction (the gate) or in the caller's, single-row or batch, row or resource.

use crate::support;

use pgfence::{Error, Fencing, Repository, Resource, table::TableName};
use support::{Logs, TestDb, audit_count, token};

#[derive(Debug, Clone, sqlx::FromRow)]
struct Acct {
    id: i64,
    balance: i64,
}
pgfence::fenced_table!(Acct { table: "acct", key: id: i64, columns: [balance] });

fn lease(n: i64, holder: &str) -> Fencing {
    Fencing::new(token(n))
        .resource(Resource::new("acct:all").unwrap())
        .holder(holder)
}

/// Runs `refuse`, which must be refused with `kind`: exactly one more audit row and one more
/// WARN event on the audit target, of that kind.
async fn once<F: std::future::Future<Output = Result<(), Error>>>(
    db: &TestDb,
    logs: &Logs,
    what: &str,
    kind: &str,
    refuse: F,
) {
    let rows = audit_count(&db.pool).await;
    let events = logs.with("pgfence::audit", "WARN").len();
    let err = refuse.await.expect_err(what);
    assert_eq!(
        err.kind(),
        pgfence::error::ErrorKind::Fenced,
        "{what}: {err:?}"
    );
    assert_eq!(audit_count(&db.pool).await, rows + 1, "{what}: audit rows");
    let new: Vec<_> = logs
        .with("pgfence::audit", "WARN")
        .into_iter()
        .skip(events)
        .collect();
    assert_eq!(new.len(), 1, "{what}: log events {new:?}");
    assert_eq!(new[0]["fields"]["kind"], kind, "{what}: {new:?}");
}

#[tokio::test]
async fn every_path_audits_and_logs_a_refusal_once() {
    let (logs, _guard) = Logs::capture();
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE acct (id bigint PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO acct SELECT g, 0 FROM generate_series(1, 4) g;",
    )
    .await;
    let table = TableName::parse("acct").unwrap();
    pgfence::guard::guard(&db.pool, &table).await.unwrap();
    let repo = Repository::<Acct>::new(db.pool.clone()).unwrap();
    let fence = pgfence::Fence::new(db.pool.clone());
    let (old, new) = (lease(3, "old"), lease(4, "new"));
    for id in 1..=4 {
        repo.update(&db.pool, &new, &Acct { id, balance: 1 })
            .await
            .unwrap();
    }
    let row = |id| Acct { id, balance: 9 };

    // Stale: on a pool (the write's own transaction), in the caller's, a claim, a batch row,
    // a resource check.
    once(&db, &logs, "stale update on a pool", "stale", async {
        repo.update(&db.pool, &old, &row(1)).await
    })
    .await;
    once(
        &db,
        &logs,
        "stale update in a transaction",
        "stale",
        async {
            let mut tx = db.pool.begin().await.unwrap();
            let r = repo.update(&mut *tx, &old, &row(1)).await;
            tx.rollback().await.unwrap();
            r
        },
    )
    .await;
    once(&db, &logs, "stale claim", "stale", async {
        repo.claim::<_, Acct>(&db.pool, &old, &2).await.map(drop)
    })
    .await;
    {
        let (rows, events) = (
            audit_count(&db.pool).await,
            logs.with("pgfence::audit", "WARN").len(),
        );
        let out = repo.update_many(&db.pool, &old, &[row(3)]).await.unwrap();
        assert!(
            matches!(
                out.rows.first(),
                Some(pgfence::repository::RowOutcome::Stale { .. })
            ),
            "{out:?}"
        );
        assert_eq!(audit_count(&db.pool).await, rows + 1, "stale batch row");
        assert_eq!(
            logs.with("pgfence::audit", "WARN").len(),
            events + 1,
            "stale batch row"
        );
    }
    let resource = Resource::new("acct:all").unwrap();
    fence.check(&db.pool, &resource, &new).await.unwrap();
    once(&db, &logs, "stale check", "stale", async {
        fence.check(&db.pool, &resource, &old).await
    })
    .await;

    // Duplicate: the same token, another holder.
    once(&db, &logs, "duplicate token", "duplicate", async {
        repo.update(&db.pool, &lease(4, "twin"), &row(4)).await
    })
    .await;

    // Sealed: a lease-less write in observe mode seals the row against its lease.
    pgfence::guard::guard_with(&db.pool, &table, pgfence::guard::GuardMode::Observe)
        .await
        .unwrap();
    db.exec("UPDATE acct SET balance = balance + 1, fence = fence + 1 WHERE id = 4")
        .await;
    once(&db, &logs, "sealed row", "sealed", async {
        repo.update(&db.pool, &new, &row(4)).await
    })
    .await;
}
