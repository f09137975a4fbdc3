//! Fences that survive the protected database's own failover: a real primary and streaming
//! standby (the testkit's `PgReplicaSet`), the standby promoted behind a stable address.
//!
//! The asynchronous case is the incident: lease A writes; the standby is cut off; lease B
//! writes (acknowledged) and zombie A is rejected; the primary dies and the standby is
//! promoted without B's write. The row looks like A's again — a 0.2-style write (no timeline)
//! proves A would be let back in — but every lease that wrote before the promotion is
//! refused with `FencedByFailover`, audited, while a new lease writes at once.

use crate::support;

use std::time::{Duration, Instant};

use pgfence::{Error, Fence, FenceToken, Fencing, Repository, Resource, error::StaleTarget};
use pgfence_testkit::{PgReplicaSet, Replication};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
struct Account {
    id: i64,
    balance: i64,
}

pgfence::fenced_table!(Account { table: "accounts", key: id: i64, columns: [balance] });

/// A lease as job code keeps it: one `Fencing` for the whole job (clones share its binding).
fn lease(token: i64, holder: &str, resource: &Resource) -> Fencing {
    Fencing::new(FenceToken::new(token).unwrap())
        .resource(resource.clone())
        .holder(holder)
}

/// A pool on the set's stable address, migrated, with one guarded account row.
async fn setup(set: &PgReplicaSet) -> PgPool {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&set.url())
        .await
        .expect("connect through the proxy");
    pgfence::admin::migrate(&pool).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO accounts VALUES (1, 0);",
    )
    .execute(&pool)
    .await
    .unwrap();
    pgfence::guard::guard(
        &pool,
        &pgfence::table::TableName::parse("accounts").unwrap(),
    )
    .await
    .unwrap();
    pool
}

async fn row(pool: &PgPool) -> (i64, i64) {
    try_row(pool).await.unwrap()
}

async fn try_row(pool: &PgPool) -> pgfence::Result<(i64, i64)> {
    Ok(
        sqlx::query_as("SELECT balance, fence >> 24 FROM accounts WHERE id = 1")
            .fetch_one(pool)
            .await?,
    )
}

/// Retries `f` while the pool still hands out connections the failover broke.
async fn after_failover<T, F, Fut>(mut f: F) -> pgfence::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = pgfence::Result<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match f().await {
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
}

#[track_caller]
fn assert_fenced_by_failover(err: &Error, token: i64, from: i64, to: i64) {
    match err {
        Error::FencedByFailover {
            presented,
            lease_timeline,
            timeline,
            ..
        } => assert_eq!(
            (*presented, *lease_timeline, *timeline),
            (token, from, to),
            "{err}"
        ),
        other => panic!("expected FencedByFailover {token} {from}->{to}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_promotion_that_lost_fenced_commits_keeps_every_older_lease_out() {
    let mut set = PgReplicaSet::start(Replication::Async).await.unwrap();
    let pool = setup(&set).await;
    let repo = Repository::<Account>::new(pool.clone()).unwrap();
    let fence = Fence::new(pool.clone());
    let resource = Resource::new("billing:run:1").unwrap();
    let a = lease(1, "job-a", &resource);
    let b = lease(2, "job-b", &resource);
    let before = set.timeline().await.unwrap();

    // A writes and checks; the standby has it.
    repo.update(
        &pool,
        &a,
        &Account {
            id: 1,
            balance: 100,
        },
    )
    .await
    .unwrap();
    fence.check(&pool, &resource, &a).await.unwrap();
    assert_eq!(a.timeline(), Some(before), "bound by its first statement");
    set.wait_replayed().await.unwrap();

    // The standby is cut off; B writes (acknowledged by the primary), zombie A is stale.
    set.cut_off_standby().await.unwrap();
    repo.update(
        &pool,
        &b,
        &Account {
            id: 1,
            balance: 200,
        },
    )
    .await
    .unwrap();
    fence.check(&pool, &resource, &b).await.unwrap();
    let err = repo
        .update(
            &pool,
            &a,
            &Account {
                id: 1,
                balance: 101,
            },
        )
        .await
        .unwrap_err();
    support::assert_stale(&err, 1, 2);

    // The primary dies; the standby is promoted: B's write and A's audit row are gone.
    let failover = set.fail_over().await.unwrap();
    let promoted = Instant::now();
    assert_eq!(failover.new_timeline, before + 1);
    let (balance, token) = after_failover(|| try_row(&pool)).await.unwrap();
    assert_eq!((balance, token), (100, 1), "the promotion lost B's write");
    assert_eq!(
        pgfence::admin::high_water(&pool, &resource).await.unwrap(),
        1
    );

    // The control: what 0.2 did. The row is A's again, so a write without a timeline (the
    // shell functions' older form) is admitted — the zombie would be back in.
    let tag = a.tag();
    let mut tx = pool.begin().await.unwrap();
    let admitted = sqlx::query(
        "UPDATE accounts SET balance = 999, fence = pgfence.next_fence(fence, 1, $1, 'accounts')
          WHERE id = 1 AND pgfence.admits(fence, 1, $1, 'accounts', '[1]')",
    )
    .bind(i32::from(tag))
    .execute(&mut *tx)
    .await
    .unwrap()
    .rows_affected();
    tx.rollback().await.unwrap();
    assert_eq!(admitted, 1, "without its timeline, zombie A gets back in");

    // With it, zombie A is refused at its first statement on the new primary...
    let err = after_failover(|| {
        repo.update(
            &pool,
            &a,
            &Account {
                id: 1,
                balance: 101,
            },
        )
    })
    .await
    .unwrap_err();
    let detected = promoted.elapsed();
    assert_fenced_by_failover(&err, 1, before, before + 1);
    assert!(
        matches!(&err, Error::FencedByFailover { target: StaleTarget::Row { table, .. }, .. } if table == "\"public\".\"accounts\""),
        "{err:?}"
    );
    // ...and so is every other statement of a lease that wrote before the promotion: its
    // check, a claim, a batch, and B, whose write the promotion lost.
    let err = fence.check(&pool, &resource, &a).await.unwrap_err();
    assert_fenced_by_failover(&err, 1, before, before + 1);
    let err = repo.claim::<_, Account>(&pool, &a, &1).await.unwrap_err();
    assert_fenced_by_failover(&err, 1, before, before + 1);
    let err = repo
        .update_many(
            &pool,
            &a,
            &[Account {
                id: 1,
                balance: 102,
            }],
        )
        .await
        .unwrap_err();
    assert_fenced_by_failover(&err, 1, before, before + 1);
    let err = repo
        .update(
            &pool,
            &b,
            &Account {
                id: 1,
                balance: 201,
            },
        )
        .await
        .unwrap_err();
    assert_fenced_by_failover(&err, 2, before, before + 1);
    let err = fence.check(&pool, &resource, &b).await.unwrap_err();
    assert_fenced_by_failover(&err, 2, before, before + 1);
    // The effect ledger records nothing for it either: no key for a late provider call.
    let effects = pgfence::Effects::new(pool.clone());
    let err = effects
        .begin(&pool, &a, "invoice:1", "charge")
        .await
        .unwrap_err();
    assert_fenced_by_failover(&err, 1, before, before + 1);
    let recorded = effects
        .status(&pool, &resource, "invoice:1", "charge")
        .await
        .unwrap();
    assert!(recorded.is_none(), "{recorded:?}");
    // The shell path (a script under `pgfence run` passes PGFENCE_TIMELINE): the
    // non-raising forms refuse too, each with its audit row.
    let held: bool = sqlx::query_scalar("SELECT pgfence.try_check($1, 1, $2, $3)")
        .bind(resource.as_str())
        .bind(i32::from(tag))
        .bind(before)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(!held);
    let written = sqlx::query(
        "UPDATE accounts SET balance = 998, fence = pgfence.next_fence(fence, 1, $1, 'accounts')
          WHERE id = 1 AND pgfence.admits(fence, 1, $1, 'accounts', '[1]', $2)",
    )
    .bind(i32::from(tag))
    .bind(before)
    .execute(&pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(written, 0);
    assert_eq!(row(&pool).await, (100, 1), "nothing was applied");

    // Every refusal is audited, with why.
    let reasons: Vec<(String, i64, Option<String>)> = sqlx::query_as(
        "SELECT operation, presented, reason FROM pgfence.audit
          WHERE reason LIKE 'failover:%' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(reasons.len(), 9, "{reasons:?}");
    assert_eq!(
        reasons[0],
        (
            "update".to_owned(),
            1,
            Some(format!(
                "failover: lease timeline {before}, database timeline {}",
                before + 1
            ))
        )
    );

    // A new lease writes at once, and fences out everything before it as usual.
    let c = lease(3, "job-c", &resource);
    let started = Instant::now();
    repo.update(
        &pool,
        &c,
        &Account {
            id: 1,
            balance: 300,
        },
    )
    .await
    .unwrap();
    fence.check(&pool, &resource, &c).await.unwrap();
    let new_lease_writes = started.elapsed();
    assert_eq!(c.timeline(), Some(before + 1));
    assert_eq!(row(&pool).await, (300, 3));

    // Zombie A again, on the row new lease C wrote: refused for the failover (and stale as
    // well), and that is one refusal — one audit row, with the failover's reason, and one
    // log event (the rejecting statement writes no row of its own for it).
    let (logs, _capture) = support::Logs::capture();
    let audited = |pool: sqlx::PgPool| async move {
        sqlx::query_as::<_, (i64, Option<String>)>(
            "SELECT presented, reason FROM pgfence.audit ORDER BY id",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    let audit_before = audited(pool.clone()).await.len();
    let err = repo
        .update(
            &pool,
            &a,
            &Account {
                id: 1,
                balance: 103,
            },
        )
        .await
        .unwrap_err();
    assert_fenced_by_failover(&err, 1, before, before + 1);
    let rows = audited(pool.clone()).await;
    let new_rows = &rows[audit_before..];
    assert_eq!(
        new_rows.len(),
        1,
        "one refusal, one audit row: {new_rows:?}"
    );
    assert!(
        new_rows[0]
            .1
            .as_deref()
            .is_some_and(|r| r.starts_with("failover:")),
        "{new_rows:?}"
    );
    let events = logs.with("pgfence::audit", "WARN");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["fields"]["kind"], "failover");
    assert_eq!(row(&pool).await, (300, 3));
    eprintln!(
        "failover took {:?} (kill {:?}); zombie refused {detected:?} after the promotion; new lease's first write+check {new_lease_writes:?}",
        failover.took, failover.kill
    );

    // doctor reports the failover until it is acknowledged.
    let findings = pgfence::admin::doctor(&pool, None, &pgfence::admin::DoctorOptions::default())
        .await
        .unwrap();
    let failed_over: Vec<_> = findings
        .iter()
        .filter(|f| f.kind == pgfence::admin::FindingKind::FailedOver)
        .collect();
    assert_eq!(failed_over.len(), 1, "{findings:?}");
    assert!(failed_over[0].is_problem());
    assert!(
        failed_over[0]
            .message
            .contains(&format!("timeline {}", before + 1)),
        "{:?}",
        failed_over[0]
    );
    assert_eq!(
        pgfence::admin::acknowledge_failover(&pool, "test")
            .await
            .unwrap(),
        1
    );
    let findings = pgfence::admin::doctor(&pool, None, &pgfence::admin::DoctorOptions::default())
        .await
        .unwrap();
    assert!(
        findings
            .iter()
            .all(|f| f.kind != pgfence::admin::FindingKind::FailedOver),
        "{findings:?}"
    );
    // Acknowledging changes nothing about fencing: A stays out.
    let err = repo
        .update(
            &pool,
            &a,
            &Account {
                id: 1,
                balance: 103,
            },
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::FencedByFailover { .. }), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_promotion_keeps_every_acknowledged_write_and_still_fences_older_leases() {
    let mut set = PgReplicaSet::start(Replication::Sync).await.unwrap();
    let pool = setup(&set).await;
    let repo = Repository::<Account>::new(pool.clone()).unwrap();
    let resource = Resource::new("billing:run:2").unwrap();
    let a = lease(1, "job-a", &resource);
    let b = lease(2, "job-b", &resource);
    let before = set.timeline().await.unwrap();

    repo.update(
        &pool,
        &a,
        &Account {
            id: 1,
            balance: 100,
        },
    )
    .await
    .unwrap();
    repo.update(
        &pool,
        &b,
        &Account {
            id: 1,
            balance: 200,
        },
    )
    .await
    .unwrap();
    let err = repo
        .update(
            &pool,
            &a,
            &Account {
                id: 1,
                balance: 101,
            },
        )
        .await
        .unwrap_err();
    support::assert_stale(&err, 1, 2);

    let failover = set.fail_over().await.unwrap();
    assert_eq!(failover.new_timeline, before + 1);
    // Nothing acknowledged was lost: B's write is there, so A is stale on the row anyway.
    let kept = after_failover(|| try_row(&pool)).await.unwrap();
    assert_eq!(kept, (200, 2));
    // Both leases predate the promotion: refused (B takes a new lease; nothing was lost, but
    // pgfence cannot tell a lossless promotion from a lossy one).
    let err = after_failover(|| {
        repo.update(
            &pool,
            &a,
            &Account {
                id: 1,
                balance: 101,
            },
        )
    })
    .await
    .unwrap_err();
    assert_fenced_by_failover(&err, 1, before, before + 1);
    let err = repo
        .update(
            &pool,
            &b,
            &Account {
                id: 1,
                balance: 201,
            },
        )
        .await
        .unwrap_err();
    assert_fenced_by_failover(&err, 2, before, before + 1);
    let c = lease(3, "job-c", &resource);
    repo.update(
        &pool,
        &c,
        &Account {
            id: 1,
            balance: 300,
        },
    )
    .await
    .unwrap();
    assert_eq!(row(&pool).await, (300, 3));
}

/// The issuer side: after a promotion that lost marks, a Redis issuer whose counter survived
/// never hands out a token the lost history had seen — neither a new acquisition nor a reseed
/// from the (now lower) marks takes the counter back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_counter_is_never_lowered_to_marks_a_promotion_rolled_back() {
    let mut set = PgReplicaSet::start(Replication::Async).await.unwrap();
    let pool = setup(&set).await;
    let fence = Fence::new(pool.clone());
    let issuer = support::issuer().await.with_floor_source(pool.clone());
    let resource = support::unique_resource("failover");
    let ttl = Duration::from_millis(200);

    let a = issuer.acquire(&resource, ttl).await.unwrap().unwrap();
    fence.check(&pool, &resource, &a).await.unwrap();
    set.wait_replayed().await.unwrap();
    set.cut_off_standby().await.unwrap();
    tokio::time::sleep(ttl * 2).await;
    let b = issuer
        .acquire_wait(&resource, ttl, Duration::from_secs(5))
        .await
        .unwrap()
        .unwrap();
    assert!(b.token() > a.token());
    fence.check(&pool, &resource, &b).await.unwrap();

    set.fail_over().await.unwrap();
    let mark = after_failover(|| pgfence::admin::high_water(&pool, &resource))
        .await
        .unwrap();
    assert_eq!(mark, a.token().get(), "the promotion lost B's mark");
    // Reseeding from the marks raises only: the counter keeps B's token.
    let counter = issuer.reseed(&pool, &resource).await.unwrap();
    assert_eq!(counter, b.token().get());
    tokio::time::sleep(ttl * 2).await;
    let c = issuer
        .acquire_wait(&resource, ttl, Duration::from_secs(5))
        .await
        .unwrap()
        .unwrap();
    assert!(c.token() > b.token(), "{} after {}", c.token(), b.token());
    fence.check(&pool, &resource, &c).await.unwrap();
    // B, acquired before the promotion, is fenced out although its token beats the mark.
    let err = fence.check(&pool, &resource, &b).await.unwrap_err();
    assert!(matches!(err, Error::FencedByFailover { .. }), "{err:?}");
}
