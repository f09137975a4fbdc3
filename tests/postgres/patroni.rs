//! Failover fencing under a real Patroni cluster (the installed `patroni` package, the
//! testkit's `PatroniCluster`: members on loopback, a throwaway etcd as the DCS, clients on a
//! proxy that follows the leader as HAProxy with `GET /leader` would).
//!
//! * asynchronous replication: the leader is killed after a write its replica never got;
//!   Patroni promotes the replica anyway (within `maximum_lag_on_failover`), the write is
//!   lost, and every lease from before the promotion is refused (`FencedByFailover`);
//! * `synchronous_mode`: the acknowledged write survives the failover, older leases are
//!   still refused;
//! * the old leader rejoins with `pg_rewind` (which discards what it had that the new leader
//!   lacks) and is promoted back by a switchover through Patroni's REST API: leases bound to
//!   either earlier timeline stay refused, and the rewound write never comes back;
//! * a second branch with a timeline number seen before (two failovers, the second promoting
//!   a replica that never followed the first): the timeline number check is defeated — a
//!   fenced-out lease lands — unless Patroni's `check_timeline` is on, which refuses that
//!   promotion (docs/failover.md, "Tested with Patroni").
//!
//! Every test skips with a message when Patroni (or its etcd module) is not installed, and is
//! bounded in time.

use crate::support;

use std::future::Future;
use std::time::{Duration, Instant};

use pgfence::admin::{DoctorOptions, FindingKind};
use pgfence::{Error, Fence, FenceToken, Fencing, Repository, Resource};
use pgfence_testkit::optional::Patroni;
use pgfence_testkit::{Installed, PatroniCluster, PatroniConfig, needs};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// Each test's bound (the failovers wait for Patroni's 10 s leader key TTL).
const BOUND: Duration = Duration::from_secs(100);

#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
struct Account {
    id: i64,
    balance: i64,
}

pgfence::fenced_table!(Account { table: "accounts", key: id: i64, columns: [balance] });

async fn bounded<F: Future<Output = ()>>(test: F) {
    tokio::time::timeout(BOUND, test)
        .await
        .unwrap_or_else(|_| panic!("the test took over {BOUND:?}"));
}

fn lease(token: i64, holder: &str, resource: &Resource) -> Fencing {
    Fencing::new(FenceToken::new(token).unwrap())
        .resource(resource.clone())
        .holder(holder)
}

fn account(balance: i64) -> Account {
    Account { id: 1, balance }
}

/// A pool on the cluster's leader address, migrated, with one guarded account row.
async fn setup(cluster: &PatroniCluster) -> PgPool {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&cluster.url())
        .await
        .expect("connect to the leader");
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
    Fut: Future<Output = pgfence::Result<T>>,
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

/// Cuts the leader `i` off from its replicas and waits until no replication connection is
/// left on it: every commit after this is missing from the replicas.
async fn cut_off(cluster: &PatroniCluster, i: usize) {
    cluster.cut_off(i).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while cluster
        .sql(i, "SELECT count(*) FROM pg_stat_replication")
        .await
        .unwrap()
        != "0"
    {
        assert!(Instant::now() < deadline, "replication still connected");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Kills the leader `i` and waits for Patroni to promote another member (the proxy follows
/// it). Returns the new leader and the time from the kill to the new leader accepting writes.
async fn kill_leader(cluster: &mut PatroniCluster, i: usize) -> (usize, Duration, Duration) {
    let killed = Instant::now();
    let kill = cluster.kill(i).await.unwrap();
    let leader = cluster.wait_leader(Some(i)).await.unwrap();
    (leader, kill, killed.elapsed())
}

async fn failed_over_findings(pool: &PgPool) -> Vec<pgfence::admin::Finding> {
    pgfence::admin::doctor(pool, None, &DoctorOptions::default())
        .await
        .unwrap()
        .into_iter()
        .filter(|f| f.kind == FindingKind::FailedOver)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patroni_async_failover_refuses_every_lease_from_before_the_promotion() {
    let Some(patroni) =
        needs::<Patroni>("patroni_async_failover_refuses_every_lease_from_before_the_promotion")
    else {
        return;
    };
    bounded(async {
        let mut cluster = PatroniCluster::start(patroni, PatroniConfig::default())
            .await
            .unwrap();
        let pool = setup(&cluster).await;
        let repo = Repository::<Account>::new(pool.clone()).unwrap();
        let fence = Fence::new(pool.clone());
        let resource = Resource::new("billing:patroni:1").unwrap();
        let a = lease(1, "job-a", &resource);
        let b = lease(2, "job-b", &resource);
        let before = cluster.timeline(0).await.unwrap();

        repo.update(&pool, &a, &account(100)).await.unwrap();
        fence.check(&pool, &resource, &a).await.unwrap();
        assert_eq!(a.timeline(), Some(before));
        cluster.wait_replayed(1).await.unwrap();

        // The replica is cut off; B writes (acknowledged), zombie A is stale.
        cut_off(&cluster, 0).await;
        repo.update(&pool, &b, &account(200)).await.unwrap();
        fence.check(&pool, &resource, &b).await.unwrap();
        let err = repo.update(&pool, &a, &account(101)).await.unwrap_err();
        support::assert_stale(&err, 1, 2);

        // The leader dies; Patroni promotes the replica, which never got B's write.
        let (leader, kill, failover) = kill_leader(&mut cluster, 0).await;
        let promoted = Instant::now();
        assert_eq!(leader, 1);
        assert_eq!(cluster.timeline(1).await.unwrap(), before + 1);
        let row = after_failover(|| try_row(&pool)).await.unwrap();
        assert_eq!(row, (100, 1), "Patroni's promotion lost B's write");

        // Zombie A is refused at its first statement on the new leader, and so is B.
        let err = after_failover(|| async { repo.update(&pool, &a, &account(101)).await })
            .await
            .unwrap_err();
        let detected = promoted.elapsed();
        assert_fenced_by_failover(&err, 1, before, before + 1);
        let err = fence.check(&pool, &resource, &a).await.unwrap_err();
        assert_fenced_by_failover(&err, 1, before, before + 1);
        let err = repo.claim::<_, Account>(&pool, &a, &1).await.unwrap_err();
        assert_fenced_by_failover(&err, 1, before, before + 1);
        let err = repo.update(&pool, &b, &account(201)).await.unwrap_err();
        assert_fenced_by_failover(&err, 2, before, before + 1);
        let err = fence.check(&pool, &resource, &b).await.unwrap_err();
        assert_fenced_by_failover(&err, 2, before, before + 1);
        assert_eq!(try_row(&pool).await.unwrap(), (100, 1), "nothing landed");

        // A new lease writes at once.
        let c = lease(3, "job-c", &resource);
        let started = Instant::now();
        repo.update(&pool, &c, &account(300)).await.unwrap();
        fence.check(&pool, &resource, &c).await.unwrap();
        let new_lease = started.elapsed();
        assert_eq!(c.timeline(), Some(before + 1));
        assert_eq!(try_row(&pool).await.unwrap(), (300, 3));
        let err = repo.update(&pool, &a, &account(102)).await.unwrap_err();
        assert_fenced_by_failover(&err, 1, before, before + 1);
        assert_eq!(try_row(&pool).await.unwrap(), (300, 3));

        // Every refusal is audited with its reason; doctor reports the failover.
        let refused: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pgfence.audit WHERE reason LIKE 'failover:%'")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(refused, 6);
        let failed_over = failed_over_findings(&pool).await;
        assert_eq!(failed_over.len(), 1, "{failed_over:?}");
        assert!(failed_over[0].is_problem());
        assert!(
            failed_over[0]
                .message
                .contains(&format!("timeline {}", before + 1)),
            "{:?}",
            failed_over[0]
        );
        eprintln!(
            "patroni async: kill {kill:?}; leader killed -> new leader writable {failover:?} \
             (ttl {} s); zombie refused {detected:?} after that; new lease's first write+check {new_lease:?}",
            pgfence_testkit::PATRONI_TTL_S
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patroni_synchronous_mode_keeps_the_acknowledged_write_and_still_refuses_older_leases() {
    let Some(patroni) = needs::<Patroni>(
        "patroni_synchronous_mode_keeps_the_acknowledged_write_and_still_refuses_older_leases",
    ) else {
        return;
    };
    bounded(async {
        let mut cluster = PatroniCluster::start(
            patroni,
            PatroniConfig {
                synchronous_mode: true,
                ..PatroniConfig::default()
            },
        )
        .await
        .unwrap();
        let pool = setup(&cluster).await;
        let repo = Repository::<Account>::new(pool.clone()).unwrap();
        let resource = Resource::new("billing:patroni:2").unwrap();
        let a = lease(1, "job-a", &resource);
        let b = lease(2, "job-b", &resource);
        let before = cluster.timeline(0).await.unwrap();
        let sync: String = sqlx::query_scalar("SHOW synchronous_standby_names")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(sync.contains("p1"), "{sync:?}");

        repo.update(&pool, &a, &account(100)).await.unwrap();
        // Acknowledged only once the synchronous standby has flushed it.
        repo.update(&pool, &b, &account(200)).await.unwrap();
        let err = repo.update(&pool, &a, &account(101)).await.unwrap_err();
        support::assert_stale(&err, 1, 2);

        let (leader, _, failover) = kill_leader(&mut cluster, 0).await;
        assert_eq!(leader, 1);
        let row = after_failover(|| try_row(&pool)).await.unwrap();
        assert_eq!(row, (200, 2), "the acknowledged write survived");
        let err = after_failover(|| async { repo.update(&pool, &a, &account(101)).await })
            .await
            .unwrap_err();
        assert_fenced_by_failover(&err, 1, before, before + 1);
        let err = repo.update(&pool, &b, &account(201)).await.unwrap_err();
        assert_fenced_by_failover(&err, 2, before, before + 1);
        let c = lease(3, "job-c", &resource);
        repo.update(&pool, &c, &account(300)).await.unwrap();
        assert_eq!(try_row(&pool).await.unwrap(), (300, 3));
        assert_eq!(failed_over_findings(&pool).await.len(), 1);
        eprintln!("patroni synchronous_mode: leader killed -> new leader writable {failover:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patroni_rewind_and_switchover_back_keep_leases_of_every_earlier_timeline_out() {
    let Some(patroni) = needs::<Patroni>(
        "patroni_rewind_and_switchover_back_keep_leases_of_every_earlier_timeline_out",
    ) else {
        return;
    };
    bounded(async {
        let mut cluster = PatroniCluster::start(patroni, PatroniConfig::default())
            .await
            .unwrap();
        let pool = setup(&cluster).await;
        let repo = Repository::<Account>::new(pool.clone()).unwrap();
        let resource = Resource::new("billing:patroni:3").unwrap();
        let a = lease(1, "job-a", &resource);
        let b = lease(2, "job-b", &resource);
        let tl1 = cluster.timeline(0).await.unwrap();

        repo.update(&pool, &a, &account(100)).await.unwrap();
        cluster.wait_replayed(1).await.unwrap();
        // B's write reaches only p0: the promotion loses it, pg_rewind later discards it.
        cut_off(&cluster, 0).await;
        repo.update(&pool, &b, &account(200)).await.unwrap();

        let (leader, _, _) = kill_leader(&mut cluster, 0).await;
        assert_eq!(leader, 1);
        cluster.reconnect(0);
        let tl2 = cluster.timeline(1).await.unwrap();
        assert_eq!(tl2, tl1 + 1);
        let d = lease(3, "job-d", &resource);
        after_failover(|| async { repo.update(&pool, &d, &account(300)).await })
            .await
            .unwrap();
        assert_eq!(d.timeline(), Some(tl2));

        // p0 rejoins: Patroni rewinds it onto p1's timeline and it streams again.
        let rejoin = Instant::now();
        cluster.restart(0).unwrap();
        cluster.wait_streaming(1).await.unwrap();
        let rejoined = rejoin.elapsed();
        let log = cluster.log_tail(0, 400);
        assert!(
            log.contains("pg_rewind"),
            "no pg_rewind in p0's log:\n{log}"
        );
        cluster.wait_replayed(0).await.unwrap();
        assert_eq!(cluster.timeline(0).await.unwrap(), tl2);

        // Switchover back to p0 through Patroni's REST API: a third timeline.
        let switch = Instant::now();
        cluster.switchover(1, 0).await.unwrap();
        let switched = switch.elapsed();
        let tl3 = cluster.timeline(0).await.unwrap();
        assert_eq!(tl3, tl2 + 1);
        let row = after_failover(|| try_row(&pool)).await.unwrap();
        assert_eq!(row, (300, 3), "the rewound write of B is gone for good");

        // Leases bound to either earlier timeline are refused; B's never lands.
        let err = after_failover(|| async { repo.update(&pool, &a, &account(101)).await })
            .await
            .unwrap_err();
        assert_fenced_by_failover(&err, 1, tl1, tl3);
        let err = repo.update(&pool, &b, &account(201)).await.unwrap_err();
        assert_fenced_by_failover(&err, 2, tl1, tl3);
        let err = repo.update(&pool, &d, &account(301)).await.unwrap_err();
        assert_fenced_by_failover(&err, 3, tl2, tl3);
        let e = lease(4, "job-e", &resource);
        repo.update(&pool, &e, &account(400)).await.unwrap();
        assert_eq!(try_row(&pool).await.unwrap(), (400, 4));
        let failed_over = failed_over_findings(&pool).await;
        assert!(
            failed_over
                .iter()
                .any(|f| f.message.contains(&format!("timeline {tl3}"))),
            "{failed_over:?}"
        );
        eprintln!("patroni rejoin (pg_rewind) {rejoined:?}; switchover {switched:?}");
    })
    .await;
}

/// Two failovers in a row on 3 members, where the member promoted second never followed the
/// first promotion (the network kept it from the first new leader): the state up to the
/// second leader's death. Returns the cluster, the pool, the first new leader `x` (on
/// timeline 2), the other replica `y` (still on timeline 1), and lease `l` bound to `x`'s
/// timeline 2 and fenced out there by lease `m`.
async fn two_failovers_apart(
    patroni: Installed<Patroni>,
    check_timeline: bool,
) -> (PatroniCluster, PgPool, usize, usize, Fencing, Fencing) {
    let mut cluster = PatroniCluster::start(
        patroni,
        PatroniConfig {
            members: 3,
            check_timeline,
            ..PatroniConfig::default()
        },
    )
    .await
    .unwrap();
    let pool = setup(&cluster).await;
    let repo = Repository::<Account>::new(pool.clone()).unwrap();
    let resource = Resource::new("billing:patroni:branch").unwrap();
    let a = lease(1, "job-a", &resource);
    repo.update(&pool, &a, &account(100)).await.unwrap();
    cluster.wait_replayed(1).await.unwrap();
    cluster.wait_replayed(2).await.unwrap();

    // A partition: no member can reach another's PostgreSQL (Patroni still talks to etcd).
    for i in 0..3 {
        cluster.cut_off(i).unwrap();
    }
    cut_off(&cluster, 0).await;
    let (x, _, _) = kill_leader(&mut cluster, 0).await;
    let y = 3 - x;
    assert_eq!(cluster.timeline(x).await.unwrap(), 2);
    // Patroni has recorded the promotion in the DCS (the cluster's timeline is 2).
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cluster.history(x).await.is_some_and(|h| h.contains("[1,")) {
        assert!(Instant::now() < deadline, "no history in the DCS");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // On x's timeline 2: lease l writes, lease m takes over, zombie l is stale.
    let l = lease(5, "job-l", &resource);
    let m = lease(6, "job-m", &resource);
    after_failover(|| async { repo.update(&pool, &l, &account(500)).await })
        .await
        .unwrap();
    repo.update(&pool, &m, &account(600)).await.unwrap();
    let err = repo.update(&pool, &l, &account(501)).await.unwrap_err();
    support::assert_stale(&err, 5, 6);
    assert_eq!((l.timeline(), m.timeline()), (Some(2), Some(2)));
    // y never streamed from x: it is still on timeline 1 and lacks l's and m's writes.
    assert_ne!(cluster.timeline(y).await.unwrap(), 2);
    cluster.kill(x).await.unwrap();
    (cluster, pool, x, y, l, m)
}

/// The sequence that defeats the timeline number: the second promotion starts a second
/// timeline 2 (y never saw x's `00000002.history`), so lease `l`, bound to x's timeline 2 and
/// fenced out there, writes on y's. Documented in docs/failover.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patroni_a_second_timeline_2_lets_a_lease_fenced_out_on_the_first_one_land() {
    let Some(patroni) = needs::<Patroni>(
        "patroni_a_second_timeline_2_lets_a_lease_fenced_out_on_the_first_one_land",
    ) else {
        return;
    };
    bounded(async {
        let (cluster, pool, x, y, l, _m) = two_failovers_apart(patroni, false).await;
        let leader = cluster.wait_leader(None).await.unwrap();
        assert_eq!(
            leader, y,
            "Patroni promoted the replica that never followed x"
        );
        assert_eq!(cluster.timeline(y).await.unwrap(), 2, "a second timeline 2");
        let repo = Repository::<Account>::new(pool.clone()).unwrap();
        let row = after_failover(|| try_row(&pool)).await.unwrap();
        assert_eq!(row, (100, 1), "m's write was on the other branch");
        // The defeat: l, fenced out by m on the first timeline 2, is admitted on the second.
        after_failover(|| async { repo.update(&pool, &l, &account(501)).await })
            .await
            .unwrap();
        assert_eq!(try_row(&pool).await.unwrap(), (501, 5));
        // A lease from timeline 1 is still refused.
        let a = lease(
            1,
            "job-a",
            &Resource::new("billing:patroni:branch").unwrap(),
        )
        .on_timeline(1);
        let err = repo.update(&pool, &a, &account(102)).await.unwrap_err();
        assert_fenced_by_failover(&err, 1, 1, 2);
        assert_eq!(try_row(&pool).await.unwrap(), (501, 5));
        // doctor sees a failover (timeline 1 -> 2 on this branch), not that it is the second
        // timeline 2. Nothing else tells the branches apart either: the system identifier
        // is the cluster's (every member's), and the history files (readable by a superuser
        // or pg_read_server_files only) both say where timeline 1 ended — the same place when
        // both replicas had replayed the same WAL, as here.
        assert_eq!(failed_over_findings(&pool).await.len(), 1);
        let system = cluster
            .sql(y, "SELECT system_identifier FROM pg_control_system()")
            .await
            .unwrap();
        let history_y = cluster
            .sql(y, "SELECT pg_read_file('pg_wal/00000002.history')")
            .await
            .unwrap();
        let history_x =
            std::fs::read_to_string(cluster.data_dir(x).join("pg_wal/00000002.history")).unwrap();
        assert!(history_x.starts_with("1\t") && history_y.starts_with("1\t"));
        eprintln!(
            "second timeline 2: system identifier {system}; x's 00000002.history {:?}, y's {:?}",
            history_x.trim(),
            history_y.trim()
        );
    })
    .await;
}

/// Patroni's `check_timeline`: a replica behind the timeline recorded in the DCS is not
/// promoted, so the second timeline 2 never starts (the cluster waits without a leader).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patroni_check_timeline_refuses_to_start_a_second_timeline_2() {
    let Some(patroni) =
        needs::<Patroni>("patroni_check_timeline_refuses_to_start_a_second_timeline_2")
    else {
        return;
    };
    bounded(async {
        let (cluster, _pool, _x, y, _l, _m) = two_failovers_apart(patroni, true).await;
        // Well past the leader key's TTL: nobody leads.
        let until = Instant::now() + Duration::from_secs(pgfence_testkit::PATRONI_TTL_S + 6);
        while Instant::now() < until {
            assert_eq!(cluster.leader().await, None);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let log = cluster.log_tail(y, 400);
        let refused = log
            .lines()
            .find(|l| l.contains("is behind last known cluster timeline"))
            .unwrap_or_else(|| panic!("{log}"));
        eprintln!("check_timeline: {refused}");
    })
    .await;
}
