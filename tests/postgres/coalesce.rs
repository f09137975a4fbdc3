//! Coalesced single-row updates (`Repository::coalesced`): concurrent updates of many leases
//! sent as one statement when they queue up, each caller getting what `Repository::update`
//! would have given it — applied, stale (audited), not found — and the race still lost by
//! the unfenced control.

use crate::support;

use std::sync::Arc;

use pgfence::{Error, Fencing, Repository, Resource, repository::Coalescer, table::TableName};
use support::{TestDb, audit_count, token};
use tokio::sync::Barrier;

#[derive(Debug, Clone, PartialEq)]
struct Account {
    id: i64,
    balance: i64,
}

pgfence::fenced_table!(Account { table: "account", key: id: i64, columns: [balance] });

fn int(i: usize) -> i64 {
    i64::try_from(i).unwrap()
}

fn lease(n: i64) -> Fencing {
    Fencing::new(token(n))
        .holder(format!("job-{n}"))
        .resource(Resource::new(format!("account:{n}")).unwrap())
}

async fn setup(rows: i64) -> (TestDb, Coalescer<Account>) {
    let db = TestDb::new().await;
    db.exec(&format!(
        "CREATE TABLE account (id bigint PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO account SELECT g, 0 FROM generate_series(1, {rows}) g;"
    ))
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("account").unwrap())
        .await
        .unwrap();
    let writer = Repository::<Account>::new(db.pool.clone())
        .unwrap()
        .coalesced(db.pool.clone())
        .with_lanes(1, 64);
    (db, writer)
}

async fn balance(db: &TestDb, id: i64) -> Option<i64> {
    sqlx::query_scalar("SELECT balance FROM account WHERE id = $1")
        .bind(id)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
}

/// Runs `update(i)` for `0..n` at once (all tasks released together) and returns the
/// results in order.
async fn at_once<F, Fut>(n: usize, update: F) -> Vec<pgfence::Result<()>>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = pgfence::Result<()>> + Send + 'static,
{
    let barrier = Arc::new(Barrier::new(n));
    let update = Arc::new(update);
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (barrier, update) = (barrier.clone(), update.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                update(i).await
            })
        })
        .collect();
    let mut results = Vec::with_capacity(n);
    for task in tasks {
        results.push(task.await.unwrap());
    }
    results
}

/// Updates rows 1..=128 at once through `writer`, each under its own lease, with every 16th
/// row written negative (what the deferred trigger of the test acts on in its group's
/// `COMMIT`) and every other row its id.
async fn every_16th_negative(writer: &Coalescer<Account>) -> Vec<pgfence::Result<()>> {
    let w = writer.clone();
    at_once(128, move |i| {
        let w = w.clone();
        let id = int(i) + 1;
        let balance = if id % 16 == 0 { -id } else { id };
        async move { w.update(lease(3000 + id), &Account { id, balance }).await }
    })
    .await
}

/// 64 leases update 64 rows at once through one lane: they are coalesced (fewer statements
/// than updates) and every update is applied with its own value and its own lease's fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_updates_of_many_leases_are_coalesced_and_all_applied() {
    let (db, writer) = setup(64).await;
    let w = writer.clone();
    let results = at_once(64, move |i| {
        let w = w.clone();
        let id = int(i) + 1;
        async move {
            w.update(
                lease(100 + id),
                &Account {
                    id,
                    balance: id * 10,
                },
            )
            .await
        }
    })
    .await;
    for (i, result) in results.iter().enumerate() {
        assert!(result.is_ok(), "update {i}: {result:?}");
    }
    for id in 1..=64 {
        assert_eq!(balance(&db, id).await, Some(id * 10));
    }
    // Each row's fence is its own lease's (the rule per row, not one lease for the group).
    let fences: Vec<(i64, i64)> = sqlx::query_as("SELECT id, fence FROM account ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    for (id, fence) in fences {
        assert_eq!(fence, lease(100 + id).lease_fence(), "row {id}");
    }
    let stats = writer.stats();
    assert!(
        stats.statements > 0 && stats.carried > stats.statements,
        "{stats:?}"
    );
    assert_eq!(stats.alone + stats.carried, 64, "{stats:?}");
    assert_eq!(stats.resent, 0, "{stats:?}");
    assert_eq!(audit_count(&db.pool).await, 0);
}

/// In a coalesced group, an old lease's late update is refused as `Repository::update`
/// refuses it — `StaleToken`, one audit row each — a missing row is `NotFound`, and the
/// fresh leases' updates are applied. The unfenced control (plain `UPDATE`s in the same
/// order) lets the old writes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_and_missing_rows_in_a_group_get_their_own_outcomes() {
    let (db, writer) = setup(48).await;
    // Rows 1..=16 were written by a newer lease (token 500): updates under token 10 are stale.
    for id in 1..=16 {
        writer
            .update(lease(500), &Account { id, balance: 1 })
            .await
            .unwrap();
    }
    let w = writer.clone();
    let results = at_once(64, move |i| {
        let w = w.clone();
        let id = int(i) + 1;
        // 1..=16 stale, 17..=48 fresh, 49..=64 missing.
        let fencing = if id <= 16 { lease(10) } else { lease(600 + id) };
        async move { w.update(fencing, &Account { id, balance: -id }).await }
    })
    .await;
    for (i, result) in results.iter().enumerate() {
        let id = int(i) + 1;
        match id {
            1..=16 => assert!(
                matches!(
                    result,
                    Err(Error::StaleToken {
                        presented: 10,
                        current: 500,
                        ..
                    })
                ),
                "row {id}: {result:?}"
            ),
            17..=48 => assert!(result.is_ok(), "row {id}: {result:?}"),
            _ => assert!(
                matches!(result, Err(Error::NotFound { .. })),
                "row {id}: {result:?}"
            ),
        }
    }
    for id in 1..=16 {
        assert_eq!(
            balance(&db, id).await,
            Some(1),
            "stale write applied to row {id}"
        );
    }
    for id in 17..=48 {
        assert_eq!(balance(&db, id).await, Some(-id));
    }
    assert_eq!(
        audit_count(&db.pool).await,
        16,
        "one audit row per stale update"
    );
    let stats = writer.stats();
    assert!(stats.resent >= 1, "{stats:?}");

    // The control: the same late writes as plain UPDATEs on an unguarded copy overwrite
    // the newer lease's rows.
    db.exec("CREATE TABLE account_plain AS SELECT id, balance FROM account")
        .await;
    let plain = db.pool.clone();
    let late = at_once(16, move |i| {
        let plain = plain.clone();
        let id = int(i) + 1;
        async move {
            sqlx::query("UPDATE account_plain SET balance = $1 WHERE id = $2")
                .bind(-id)
                .bind(id)
                .execute(&plain)
                .await
                .map(drop)
                .map_err(Error::from)
        }
    })
    .await;
    assert!(late.iter().all(Result::is_ok));
    let lost: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM account_plain WHERE id <= 16 AND balance OPERATOR(pg_catalog.<) 0",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(lost, 16, "the unfenced late writes won");
}

/// Two leases update the same row in one group: the newer one's write stands whatever the
/// order, the older one is told it is stale (never both applied, never both refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_leases_on_one_row_in_a_group_newer_wins() {
    let (db, writer) = setup(32).await;
    let w = writer.clone();
    let results = at_once(64, move |i| {
        let w = w.clone();
        // Pairs: tasks 2k and 2k+1 write row k+1, under tokens 1000+2k (older) and 1000+2k+1.
        let id = int(i / 2) + 1;
        let n = 1000 + int(i);
        async move { w.update(lease(n), &Account { id, balance: n }).await }
    })
    .await;
    for (pair, id) in (1..=32_i64).enumerate() {
        let (older, newer) = (&results[pair * 2], &results[pair * 2 + 1]);
        assert!(newer.is_ok(), "row {id}: newer {newer:?}");
        let newer_token = 1000 + (id - 1) * 2 + 1;
        assert_eq!(balance(&db, id).await, Some(newer_token), "row {id}");
        // The older one either ran first (applied, then overwritten) or after (stale).
        assert!(
            older.is_ok() || matches!(older, Err(Error::StaleToken { .. })),
            "row {id}: older {older:?}"
        );
    }
}

/// With nothing queued an update is sent at once, alone (no statement of the coalescer's
/// own), and is refused like `Repository::update` refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lone_update_goes_through_at_once() {
    let (db, writer) = setup(4).await;
    writer
        .update(lease(7), &Account { id: 1, balance: 70 })
        .await
        .unwrap();
    assert_eq!(balance(&db, 1).await, Some(70));
    let stats = writer.stats();
    assert_eq!((stats.alone, stats.statements), (1, 0), "{stats:?}");
    let err = writer
        .update(lease(3), &Account { id: 1, balance: 30 })
        .await
        .unwrap_err();
    assert!(err.is_stale(), "{err}");
    assert_eq!(audit_count(&db.pool).await, 1);
}

/// Every call keeps its bound: with the one lane stuck behind a row lock, an update queued
/// behind it on the same row is answered within its own bound (`TimedOut`: withdrawn from the
/// queue, or carried by a statement bounded by its deadline), and — once the server noticed
/// the closed connections — applies nothing later when the lock goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queued_update_times_out_within_its_bound_and_applies_nothing() {
    let (db, _) = setup(4).await;
    let bound = std::time::Duration::from_millis(300);
    let writer = Repository::<Account>::new(db.pool.clone())
        .unwrap()
        .with_call_timeout(bound)
        .unwrap()
        .coalesced(db.pool.clone())
        .with_lanes(1, 64);
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM account WHERE id = 1 FOR UPDATE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let first = {
        let w = writer.clone();
        tokio::spawn(async move { w.update(lease(20), &Account { id: 1, balance: 20 }).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let started = std::time::Instant::now();
    // Behind the stuck one, on the locked row too: the statement that carries it waits.
    let queued = writer
        .update(lease(21), &Account { id: 1, balance: 21 })
        .await;
    let waited = started.elapsed();
    assert!(
        matches!(
            queued,
            Err(Error::TimedOut {
                outcome: pgfence::error::TimedOut::NotApplied | pgfence::error::TimedOut::InDoubt,
                ..
            })
        ),
        "{queued:?}"
    );
    assert!(
        waited < bound + std::time::Duration::from_millis(150),
        "{waited:?}"
    );
    assert!(matches!(first.await.unwrap(), Err(Error::TimedOut { .. })));
    // A cut-off statement's connection is closed; the server ends the statement at its next
    // check of the client (`client_connection_check_interval`, 1 s, set by the migration).
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    blocker.rollback().await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(
        balance(&db, 2).await,
        Some(0),
        "the withdrawn update applied later"
    );
    assert_eq!(balance(&db, 1).await, Some(0));
}

/// Groups that queue up behind each other chain their transactions: a group's `COMMIT` goes
/// in the same round trip as the next group's `BEGIN` (`stats.chained`), and every update is
/// still applied, each with its own lease's fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queued_groups_chain_their_commits_and_every_update_lands() {
    let (db, writer) = setup(256).await;
    let writer = writer.with_lanes(1, 8);
    let w = writer.clone();
    let results = at_once(256, move |i| {
        let w = w.clone();
        let id = int(i) + 1;
        async move {
            w.update(lease(2000 + id), &Account { id, balance: id })
                .await
        }
    })
    .await;
    for (i, result) in results.iter().enumerate() {
        assert!(result.is_ok(), "update {i}: {result:?}");
    }
    let wrong: i64 =
        sqlx::query_scalar("SELECT count(*) FROM account WHERE balance OPERATOR(pg_catalog.<>) id")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(wrong, 0, "rows without their update");
    let fences: Vec<(i64, i64)> = sqlx::query_as("SELECT id, fence FROM account")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    for (id, fence) in fences {
        assert_eq!(fence, lease(2000 + id).lease_fence(), "row {id}");
    }
    let stats = writer.stats();
    assert!(stats.chained >= 1, "no chained commit: {stats:?}");
    assert_eq!(stats.applied, stats.carried, "{stats:?}");
    assert_eq!(stats.alone + stats.carried, 256, "{stats:?}");
}

/// Closed-loop workers (each sends its next update as soon as the last one returns) ride one
/// group together: the callers a `COMMIT` answers queue again before the next group is
/// taken, so a group carries nearly all 16 of them. Taking the next group before that
/// `COMMIT` (as the first version of this coalescer did) splits them into two alternating halves of 8,
/// every caller waiting for the other half's group as well as its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_callers_ride_one_group_together() {
    const WORKERS: usize = 16;
    const ROUNDS: i64 = 60;
    let (db, writer) = setup(int(WORKERS)).await;
    let w = writer.clone();
    let results = at_once(WORKERS, move |i| {
        let w = w.clone();
        let id = int(i) + 1;
        async move {
            for balance in 1..=ROUNDS {
                w.update(lease(3000 + id), &Account { id, balance }).await?;
            }
            Ok(())
        }
    })
    .await;
    for (i, result) in results.iter().enumerate() {
        assert!(result.is_ok(), "worker {i}: {result:?}");
    }
    for id in 1..=int(WORKERS) {
        assert_eq!(balance(&db, id).await, Some(ROUNDS), "row {id}");
    }
    let stats = writer.stats();
    assert_eq!(
        stats.alone + stats.carried,
        u64::try_from(int(WORKERS) * ROUNDS).unwrap(),
        "{stats:?}"
    );
    assert_eq!(stats.resent, 0, "{stats:?}");
    let per_statement = stats.carried as f64 / stats.statements.max(1) as f64;
    eprintln!("{stats:?}: {per_statement:.1} updates per statement");
    assert!(
        per_statement > 10.0,
        "groups of {per_statement:.1}: the callers split into cohorts ({stats:?})"
    );
}

/// A group whose `COMMIT` fails (a deferred constraint one row breaks) keeps nothing: each
/// caller sends its update alone, so the rows that break nothing are applied and the one
/// that does gets the constraint's error, as `Repository::update` would give it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_group_whose_commit_fails_is_sent_again_row_by_row() {
    let (db, writer) = setup(128).await;
    db.exec(
        "CREATE FUNCTION no_negative() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN IF NEW.balance < 0 THEN RAISE EXCEPTION 'negative balance' USING ERRCODE = '23514'; END IF;
         RETURN NULL; END $$;
         CREATE CONSTRAINT TRIGGER no_negative AFTER UPDATE ON account
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION no_negative();",
    )
    .await;
    let writer = writer.with_lanes(1, 16);
    // Every 16th row is written negative: its group's COMMIT fails.
    let results = every_16th_negative(&writer).await;
    for (i, result) in results.iter().enumerate() {
        let id = int(i) + 1;
        if id % 16 == 0 {
            let Err(Error::Backend(b)) = result else {
                panic!("row {id}: {result:?}");
            };
            assert_eq!(b.sqlstate(), Some("23514"), "row {id}: {b}");
            assert_eq!(balance(&db, id).await, Some(0), "row {id}");
        } else {
            assert!(result.is_ok(), "row {id}: {result:?}");
            assert_eq!(balance(&db, id).await, Some(id), "row {id}");
        }
    }
    let stats = writer.stats();
    assert!(stats.resent >= 8, "{stats:?}");
}

/// A group whose `COMMIT` gets no answer — its backend ends during the `COMMIT` (a deferred
/// trigger terminates it) — may have committed: every caller in it is told so, with a
/// retryable error that says the update applied or not, and none is sent again (a second
/// send could be told "stale" for a write that landed). Here the trigger ran before the
/// commit record, so nothing of those groups landed, and a retry with the same lease applies.
#[tokio::test]
async fn a_group_whose_commit_gets_no_answer_is_in_doubt_and_not_sent_again() {
    let (db, writer) = setup(128).await;
    db.exec(
        "CREATE FUNCTION end_backend() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.balance < 0 THEN
                 PERFORM pg_catalog.pg_terminate_backend(pg_catalog.pg_backend_pid());
                 PERFORM pg_catalog.pg_sleep(5);
             END IF;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER end_backend AFTER UPDATE ON account
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION end_backend();",
    )
    .await;
    let writer = writer.with_lanes(1, 16);
    // Every 16th row is written negative: the COMMIT that carries it ends its backend.
    let results = every_16th_negative(&writer).await;
    let mut in_doubt = Vec::new();
    for (i, result) in results.iter().enumerate() {
        let id = int(i) + 1;
        match result {
            Ok(()) => {
                assert_ne!(id % 16, 0, "row {id} applied");
                assert_eq!(balance(&db, id).await, Some(id), "row {id}");
            }
            Err(e) => {
                assert!(e.is_retryable(), "row {id}: {e}");
                assert_eq!(balance(&db, id).await, Some(0), "row {id}: {e}");
                if id % 16 != 0 {
                    // A group-mate of a poisoned row (alone, the poisoned row gets its own
                    // COMMIT's error).
                    assert!(e.to_string().contains("applied or not"), "row {id}: {e}");
                    in_doubt.push(id);
                }
            }
        }
    }
    let stats = writer.stats();
    assert!(
        !in_doubt.is_empty(),
        "no poisoned row shared a group: {stats:?}"
    );
    assert_eq!(
        stats.resent, 0,
        "an in-doubt group must not be sent again: {stats:?}"
    );
    // The retry the error asks for: the same lease, the same values.
    let repo = writer.repository().clone();
    for id in in_doubt {
        repo.update(&db.pool, lease(3000 + id), &Account { id, balance: id })
            .await
            .unwrap();
        assert_eq!(balance(&db, id).await, Some(id), "row {id}");
    }
}
