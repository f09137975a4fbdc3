//! Where a rejection's audit row comes from, and what happens when it cannot be written.
//!
//! Outside a caller transaction the rejecting statement writes the row itself; inside one,
//! the auditor's own pool does (so the row survives the caller's rollback). Each test pins
//! one path by giving the auditor a pool that cannot connect: rows that still appear were
//! written by the statement.

use crate::support;

use std::time::{Duration, Instant};

use pgfence::{
    Fencing, Repository, Resource, audit::Auditor, repository::Upserted, table::TableName,
};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use support::{Logs, TestDb, assert_stale, audit_count, token};

#[derive(Debug, Clone, PartialEq)]
struct Account {
    id: i32,
    balance: i64,
}

pgfence::fenced_table!(Account { table: "account", key: id: i32, columns: [balance] });

async fn setup() -> TestDb {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE account (id int PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO account VALUES (1, 100), (2, 200);",
    )
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("account").unwrap())
        .await
        .unwrap();
    // Rows 1 and 2 carry fence 10.
    let repo = Repository::<Account>::new(db.pool.clone()).unwrap();
    for id in [1, 2] {
        repo.update(&db.pool, token(10), &Account { id, balance: 0 })
            .await
            .unwrap();
    }
    db
}

/// A pool that never connects: audit rows sent through it are lost (and reported).
fn dead_pool() -> PgPool {
    PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy("postgres://pgfence@127.0.0.1:1/nowhere")
        .unwrap()
}

fn repo_with(auditor: Auditor) -> Repository<Account> {
    Repository::with_auditor(auditor).unwrap()
}

fn stale_ctx() -> Fencing {
    Fencing::new(token(7))
        .resource(Resource::new("ledger:7").unwrap())
        .holder("worker-7")
}

async fn balances(db: &TestDb) -> Vec<(i32, i64, i64)> {
    sqlx::query_as("SELECT id, balance, fence FROM account ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn outside_a_transaction_the_rejecting_statement_writes_the_audit_row() {
    let (logs, _guard) = Logs::capture();
    let db = setup().await;
    let before = balances(&db).await;
    let repo = repo_with(Auditor::new(dead_pool()));

    let row = Account { id: 1, balance: -1 };
    assert_stale(
        &repo.update(&db.pool, stale_ctx(), &row).await.unwrap_err(),
        7,
        10,
    );
    assert_stale(
        &repo.upsert(&db.pool, stale_ctx(), &row).await.unwrap_err(),
        7,
        10,
    );
    assert_stale(
        &repo.delete(&db.pool, stale_ctx(), &2).await.unwrap_err(),
        7,
        10,
    );
    assert_eq!(balances(&db).await, before, "a stale write changed data");

    // All three rows exist although the auditor's pool never connected.
    let rows = pgfence::audit::list(&db.pool, &Default::default())
        .await
        .unwrap();
    let ops: Vec<&str> = rows.iter().rev().map(|r| r.operation.as_str()).collect();
    assert_eq!(ops, ["update", "upsert", "delete"]);
    for r in &rows {
        assert_eq!((r.presented, r.current), (7, Some(10)));
        assert_eq!(r.resource.as_deref(), Some("ledger:7"));
        assert_eq!(r.holder.as_deref(), Some("worker-7"));
        assert_eq!(r.table.as_deref(), Some("\"public\".\"account\""));
    }
    assert_eq!(rows[0].key.as_deref(), Some("[2]"));
    assert_eq!(rows[2].key.as_deref(), Some("[1]"));
    // One WARN per rejection, no audit failure.
    assert_eq!(logs.with(pgfence::audit::LOG_TARGET, "WARN").len(), 3);
    assert!(logs.with(pgfence::audit::LOG_TARGET, "ERROR").is_empty());

    // Control: with statement-written rows turned off, the same rejections have no row and
    // each one says so.
    let repo = repo_with(Auditor::new(dead_pool()).in_statement(false));
    assert_stale(
        &repo.update(&db.pool, stale_ctx(), &row).await.unwrap_err(),
        7,
        10,
    );
    assert_eq!(audit_count(&db.pool).await, 3);
    let errors = logs.with(pgfence::audit::LOG_TARGET, "ERROR");
    assert_eq!(errors.len(), 1, "{:?}", logs.events());
    assert_eq!(errors[0]["fields"]["operation"], "update");
}

#[tokio::test]
async fn inside_a_transaction_the_statement_leaves_the_row_to_the_auditor() {
    let (logs, _guard) = Logs::capture();
    let db = setup().await;

    // The auditor cannot write: if the statement wrote the row inside the caller's
    // transaction, it would appear once the caller commits.
    let repo = repo_with(Auditor::new(dead_pool()));
    let mut tx = db.pool.begin().await.unwrap();
    let err = repo
        .update(&mut *tx, stale_ctx(), &Account { id: 1, balance: -1 })
        .await
        .unwrap_err();
    assert_stale(&err, 7, 10);
    tx.commit().await.unwrap();
    assert_eq!(audit_count(&db.pool).await, 0);
    assert_eq!(logs.with(pgfence::audit::LOG_TARGET, "ERROR").len(), 1);

    // With a working auditor the row is written outside the transaction and survives its
    // rollback.
    let repo = Repository::<Account>::new(db.pool.clone()).unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let err = repo
        .upsert(&mut *tx, stale_ctx(), &Account { id: 2, balance: -1 })
        .await
        .unwrap_err();
    assert_stale(&err, 7, 10);
    tx.rollback().await.unwrap();
    let rows = pgfence::audit::list(&db.pool, &Default::default())
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].operation, "upsert");
    assert_eq!(rows[0].key.as_deref(), Some("[2]"));

    // A fresh write in a transaction is unaffected.
    let mut tx = db.pool.begin().await.unwrap();
    let done = repo
        .upsert(&mut *tx, token(11), &Account { id: 3, balance: 3 })
        .await
        .unwrap();
    assert_eq!(done, Upserted::Inserted);
    tx.commit().await.unwrap();
    assert_eq!(audit_count(&db.pool).await, 1);
}

#[tokio::test]
async fn a_locked_audit_table_costs_a_rejection_the_timeout_not_its_error() {
    let (logs, _guard) = Logs::capture();
    let db = setup().await;
    let before = balances(&db).await;
    // One connection, so the lock_timeout check below looks at the connection that ran the
    // rejecting statement.
    let single = db.pool(1).await;
    let repo = repo_with(Auditor::new(single.clone()).timeout(Duration::from_millis(300)));

    let mut locker = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE pgfence.audit IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();

    // Outside a transaction: the statement's own insert gives up after the lock timeout.
    let started = Instant::now();
    let err = repo
        .update(&single, stale_ctx(), &Account { id: 1, balance: -1 })
        .await
        .unwrap_err();
    let waited = started.elapsed();
    assert_stale(&err, 7, 10);
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    let errors = logs.with(pgfence::audit::LOG_TARGET, "ERROR");
    assert_eq!(errors.len(), 1, "{:?}", logs.events());
    let why = errors[0]["fields"]["error"].as_str().unwrap_or_default();
    assert!(why.contains("lock timeout"), "{why}");

    // Inside a transaction: the auditor's insert gives up after the same timeout.
    let mut tx = db.pool.begin().await.unwrap();
    let started = Instant::now();
    let err = repo.delete(&mut *tx, stale_ctx(), &2).await.unwrap_err();
    let waited = started.elapsed();
    assert_stale(&err, 7, 10);
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    tx.rollback().await.unwrap();
    assert_eq!(logs.with(pgfence::audit::LOG_TARGET, "ERROR").len(), 2);

    locker.rollback().await.unwrap();
    assert_eq!(audit_count(&db.pool).await, 0);
    assert_eq!(balances(&db).await, before);

    // The statement's lock timeout did not outlive it on the connection.
    let setting: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&single)
        .await
        .unwrap();
    assert_eq!(setting, "0");
}

#[tokio::test]
async fn a_role_that_may_not_write_the_audit_table_still_gets_its_stale_token() {
    let (logs, _guard) = Logs::capture();
    let db = setup().await;
    let before = balances(&db).await;
    let role = format!("pgfence_no_audit_{}", rand::random::<u32>());
    db.exec(&format!(
        "CREATE ROLE {role} NOLOGIN;
         GRANT USAGE ON SCHEMA pgfence TO {role};
         GRANT SELECT, UPDATE ON account TO {role};"
    ))
    .await;
    // Connections that act as the role (SET ROLE works on any server we can log in to).
    let set_role = format!("SET ROLE {role}");
    let limited = PgPoolOptions::new()
        .max_connections(2)
        .after_connect(move |conn, _| {
            let set_role = set_role.clone();
            Box::pin(async move {
                sqlx::raw_sql(sqlx::AssertSqlSafe(set_role))
                    .execute(conn)
                    .await?;
                Ok(())
            })
        })
        .connect_with(db.options.clone())
        .await
        .unwrap();
    let repo = Repository::<Account>::new(limited.clone()).unwrap();

    let err = repo
        .update(&limited, stale_ctx(), &Account { id: 1, balance: -1 })
        .await
        .unwrap_err();
    assert_stale(&err, 7, 10);
    let errors = logs.with(pgfence::audit::LOG_TARGET, "ERROR");
    assert_eq!(errors.len(), 1, "{:?}", logs.events());
    let why = errors[0]["fields"]["error"].as_str().unwrap_or_default();
    assert!(why.contains("permission denied"), "{why}");
    assert_eq!(audit_count(&db.pool).await, 0);
    assert_eq!(balances(&db).await, before);

    // A fresh write by the same role is unaffected.
    repo.update(&limited, token(11), &Account { id: 1, balance: 5 })
        .await
        .unwrap();
    limited.close().await;
    db.exec(&format!("DROP OWNED BY {role}; DROP ROLE {role};"))
        .await;
}

#[tokio::test]
async fn audit_list_filters_by_resource_prefix() {
    let db = TestDb::new().await;
    let fence = pgfence::Fence::new(db.pool.clone());
    for name in ["billing:1", "billing:2", "reports:x", "billing"] {
        let r = Resource::new(name).unwrap();
        fence.check(&db.pool, &r, token(5)).await.unwrap();
        assert!(
            fence
                .check(&db.pool, &r, token(4))
                .await
                .unwrap_err()
                .is_stale()
        );
    }
    let list = |resource: &str| {
        let filter = pgfence::audit::AuditFilter {
            resource: Some(resource.to_owned()),
            ..Default::default()
        };
        let pool = db.pool.clone();
        async move { pgfence::audit::list(&pool, &filter).await.unwrap() }
    };
    let mut prefixed: Vec<String> = list("billing:*")
        .await
        .into_iter()
        .filter_map(|e| e.resource)
        .collect();
    prefixed.sort();
    assert_eq!(prefixed, ["billing:1", "billing:2"]);
    assert_eq!(
        list("billing").await.len(),
        1,
        "without '*' the match is exact"
    );
    assert_eq!(list("*").await.len(), 4);
}

/// A pool on `db` whose connections carry `application_name` (what the test's `COMMIT`
/// trigger looks at).
async fn named_pool(db: &TestDb, name: &str) -> PgPool {
    let options: sqlx::postgres::PgConnectOptions = db.url().parse().unwrap();
    PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.application_name(name))
        .await
        .unwrap()
}

/// The audit rows of `key`, oldest first: (presented, current, reason).
async fn rows_of(db: &TestDb, key: &str) -> Vec<(i64, Option<i64>, Option<String>)> {
    sqlx::query_as(
        "SELECT presented, current, reason FROM pgfence.audit WHERE row_key = $1 ORDER BY id",
    )
    .bind(key)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// A rejection outside a caller transaction writes its audit row in its explaining
/// statement, which commits on its own. When that commit fails, the row goes with it and the
/// statement runs again with the row left to the auditor's pool; a backend that ends while
/// committing, or a call cut off there, never delivered its explanation: the call fails
/// (retryably, or `TimedOut`) and logs no rejection it did not see. Batches still run in a
/// transaction of their own, whose refused `COMMIT` writes the held rows again. A deferred
/// trigger on the audit table makes the writes' commits fail on demand (by connection name, so
/// the auditor's own pool is not affected).
#[tokio::test]
async fn a_rejection_keeps_its_audit_row_when_the_write_s_commit_fails() {
    let (logs, _guard) = Logs::capture();
    let db = setup().await;
    db.exec(
        "CREATE FUNCTION public.fail_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             CASE current_setting('application_name')
             WHEN 'refused-commit' THEN
                 RAISE EXCEPTION 'COMMIT refused by the test';
             WHEN 'killed-commit' THEN
                 PERFORM pg_catalog.pg_terminate_backend(pg_catalog.pg_backend_pid());
                 PERFORM pg_catalog.pg_sleep(5);
             WHEN 'slow-commit' THEN
                 PERFORM pg_catalog.pg_sleep(5);
             ELSE
             END CASE;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER fail_commit AFTER INSERT ON pgfence.audit
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.fail_commit();",
    )
    .await;
    let repo = Repository::<Account>::new(db.pool.clone()).unwrap();
    repo.update(&db.pool, token(12), &Account { id: 2, balance: 2 })
        .await
        .unwrap();
    let before = balances(&db).await;
    let stale = Account { id: 1, balance: -1 };

    // A commit the server refuses: the row went with it, and the auditor's pool wrote it.
    let refused = named_pool(&db, "refused-commit").await;
    assert_stale(
        &repo
            .update(&refused, stale_ctx(), &stale)
            .await
            .unwrap_err(),
        7,
        10,
    );
    assert_eq!(rows_of(&db, "[1]").await, [(7, Some(10), None)]);
    assert!(logs.with(pgfence::audit::LOG_TARGET, "ERROR").is_empty());

    // A batch: row 1 applies, row 2 is stale; the refused COMMIT takes row 1's write back
    // (the call fails) and row 2's audit row is written again.
    let err = repo
        .update_many(
            &refused,
            token(11),
            &[
                Account { id: 1, balance: 11 },
                Account { id: 2, balance: 11 },
            ],
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("COMMIT refused"), "{err}");
    assert_eq!(balances(&db).await, before);
    assert_eq!(rows_of(&db, "[2]").await, [(11, Some(12), None)]);
    let again = |logs: &Logs| {
        logs.with(pgfence::audit::LOG_TARGET, "WARN")
            .into_iter()
            .filter(|e| {
                e["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("again"))
            })
            .count()
    };
    assert_eq!(again(&logs), 1, "{:?}", logs.events());

    // A backend that ends while committing the explaining statement: its answer never came,
    // so the call fails retryably, nothing was written (the commit did not happen), and no
    // rejection is logged that the call did not see.
    let killed = named_pool(&db, "killed-commit").await;
    let warns = logs.with(pgfence::audit::LOG_TARGET, "WARN").len();
    let err = repo.update(&killed, stale_ctx(), &stale).await.unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    assert_eq!(rows_of(&db, "[1]").await.len(), 1);
    assert_eq!(logs.with(pgfence::audit::LOG_TARGET, "WARN").len(), warns);

    // A call cut off while the explaining statement commits: `TimedOut`, in doubt; its
    // connection is closed, and the server ends the statement before its commit
    // (client_connection_check_interval, set by the migration): no row.
    let slow = named_pool(&db, "slow-commit").await;
    let bounded = repo
        .clone()
        .with_call_timeout(Duration::from_millis(300))
        .unwrap();
    let err = bounded
        .update(&slow, stale_ctx(), &stale)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            pgfence::Error::TimedOut {
                outcome: pgfence::error::TimedOut::InDoubt,
                ..
            }
        ),
        "{err:?}"
    );
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert_eq!(rows_of(&db, "[1]").await.len(), 1);
    assert!(logs.with(pgfence::audit::LOG_TARGET, "ERROR").is_empty());
    assert_eq!(balances(&db).await, before);
}
