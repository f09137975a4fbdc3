//! The ZooKeeper issuer (feature `zk`) against real ZooKeeper: the other issuers' lease
//! semantics, a paused holder fenced by Postgres, a dead holder's lock ending with its session,
//! and a 3-server ensemble that loses its leader mid-run.
//!
//! Each test starts (or shares) throwaway ZooKeeper servers from the installed `zookeeper`
//! package on 127.0.0.1, and prints a message and passes when ZooKeeper is not installed.
//! `PGFENCE_ZK_URL` (`zk://host:port,...`) points the single-server tests at a running ensemble
//! instead.
#![cfg(feature = "zk")]

mod support;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::time::Duration;

use pgfence::{
    Error, LeaseState, ReleaseOutcome, Repository, Resource, TableName, ZkIssuer, zk_lock_dir,
};
use pgfence_testkit::{ZkEnsemble, zk_installed};
use support::{TestDb, unique_resource};
use tokio::sync::OnceCell;
use tokio::time::Instant;

const SEC: Duration = Duration::from_secs(1);

static SINGLE: OnceCell<(String, Option<ZkEnsemble>)> = OnceCell::const_new();

fn skip(test: &str) -> bool {
    if std::env::var("PGFENCE_ZK_URL").is_ok_and(|u| !u.is_empty()) || zk_installed() {
        return false;
    }
    eprintln!(
        "SKIPPED {test}: ZooKeeper is not installed (Debian: apt-get install zookeeper; or set \
         PGFENCE_ZK_URL to a running ensemble)"
    );
    true
}

/// The URL of the ZooKeeper the single-server tests share (one throwaway server per binary).
async fn zk_url() -> String {
    SINGLE
        .get_or_init(|| async {
            match std::env::var("PGFENCE_ZK_URL") {
                Ok(url) if !url.is_empty() => (url, None),
                _ => {
                    let node = ZkEnsemble::single()
                        .await
                        .expect("start throwaway ZooKeeper");
                    (node.url(), Some(node))
                }
            }
        })
        .await
        .0
        .clone()
}

/// An issuer on the shared ZooKeeper (one session per test: each test has its own runtime).
async fn issuer() -> ZkIssuer {
    ZkIssuer::connect(&zk_url().await)
        .await
        .expect("connect to ZooKeeper")
}

/// A raw client on `url`'s servers, to look under the issuer.
async fn raw(url: &str) -> zookeeper_client::Client {
    zookeeper_client::Client::connect(url.trim_start_matches("zk://"))
        .await
        .unwrap()
}

/// 8 tasks × 40 acquisitions of one lock: one holder at a time, tokens strictly increase in
/// grant order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_acquisitions_are_exclusive_and_strictly_increasing() {
    if skip("concurrent_acquisitions") {
        return;
    }
    let issuer = issuer().await;
    let resource = unique_resource("zk-contended");
    let inside = Arc::new(AtomicI32::new(0));
    let granted = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (issuer, resource, inside, granted) = (
            issuer.clone(),
            resource.clone(),
            inside.clone(),
            granted.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut got = 0;
            while got < 40 {
                let Some(lease) = issuer.acquire(&resource, 10 * SEC).await.unwrap() else {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                };
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders at once"
                );
                granted.lock().unwrap().push(lease.token().get());
                assert_eq!(inside.fetch_sub(1, Ordering::SeqCst), 1);
                assert_eq!(
                    issuer.release(&lease).await.unwrap(),
                    ReleaseOutcome::Released
                );
                got += 1;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let granted = granted.lock().unwrap().clone();
    assert_eq!(granted.len(), 8 * 40);
    assert!(
        granted.windows(2).all(|w| w[0] < w[1]),
        "tokens strictly increase in grant order"
    );
    let status = issuer.status(&resource).await.unwrap();
    assert_eq!(status.owner, None, "released");
    assert!(status.counter > *granted.last().unwrap(), "{status:?}");
}

#[tokio::test]
async fn expired_lease_cannot_release_or_extend_the_next_holders_lock() {
    if skip("expired_lease") {
        return;
    }
    let issuer = issuer().await;
    let resource = unique_resource("zk-expiry");
    let mut a = issuer
        .acquire(&resource, Duration::from_millis(300))
        .await
        .unwrap()
        .unwrap();
    assert!(
        issuer.acquire(&resource, SEC).await.unwrap().is_none(),
        "held by A"
    );
    let b = issuer
        .acquire_wait(&resource, 10 * SEC, 10 * SEC)
        .await
        .unwrap()
        .expect("A's lease expires");
    assert_eq!(a.remaining(), Duration::ZERO, "local deadline errs early");
    assert!(b.token() > a.token());
    assert_eq!(
        issuer.release(&a).await.unwrap(),
        ReleaseOutcome::TakenByOther
    );
    assert_eq!(
        issuer.extend(&mut a, 10 * SEC).await.unwrap(),
        LeaseState::Taken
    );
    let status = issuer.status(&resource).await.unwrap();
    assert_eq!(
        (status.owner.as_deref(), status.token),
        (Some(b.owner()), Some(b.token().get()))
    );
    assert!(status.ttl_ms.is_some_and(|ms| (1..=10_000).contains(&ms)));

    assert_eq!(issuer.release(&b).await.unwrap(), ReleaseOutcome::Released);
    assert_eq!(
        issuer.release(&b).await.unwrap(),
        ReleaseOutcome::AlreadyExpired,
        "nobody holds it now"
    );
    let mut b = b;
    assert_eq!(
        issuer.extend(&mut b, SEC).await.unwrap(),
        LeaseState::Expired
    );
    let status = issuer.status(&resource).await.unwrap();
    assert_eq!(
        (status.owner, status.token, status.ttl_ms),
        (None, None, None)
    );
}

#[tokio::test]
async fn owner_extend_keeps_the_lock_past_its_ttl() {
    if skip("owner_extend") {
        return;
    }
    let issuer = issuer().await;
    let resource = unique_resource("zk-extend");
    let mut lease = issuer.acquire(&resource, SEC).await.unwrap().unwrap();
    let token = lease.token();

    // Same TTL.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        issuer.extend(&mut lease, SEC).await.unwrap(),
        LeaseState::Held
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        issuer.acquire(&resource, SEC).await.unwrap().is_none(),
        "still held 1.4 s after a 1 s lease was taken"
    );

    // Another TTL: the token stays.
    assert_eq!(
        issuer.extend(&mut lease, 3 * SEC).await.unwrap(),
        LeaseState::Held
    );
    assert_eq!(lease.token(), token);
    assert_eq!(lease.ttl(), 3 * SEC);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(lease.remaining() > SEC);
    assert!(
        issuer.acquire(&resource, SEC).await.unwrap().is_none(),
        "still held after the original TTL"
    );
    let status = issuer.status(&resource).await.unwrap();
    assert_eq!(status.token, Some(token.get()));
    assert!(status.ttl_ms.is_some_and(|ms| ms >= 1000), "{status:?}");
    assert_eq!(
        issuer.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
}

#[tokio::test]
async fn retried_acquire_by_the_same_owner_returns_the_same_token() {
    if skip("retried_acquire") {
        return;
    }
    let issuer = issuer().await;
    let resource = unique_resource("zk-retry");
    let owner = pgfence::new_owner_id();
    let first = issuer
        .acquire_as(&resource, &owner, 5 * SEC)
        .await
        .unwrap()
        .unwrap();
    let again = issuer
        .acquire_as(&resource, &owner, 5 * SEC)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.token(), again.token());
    assert_eq!(
        issuer.status(&resource).await.unwrap().token,
        Some(first.token().get()),
        "no new token"
    );
    let other = issuer
        .acquire_as(&resource, &pgfence::new_owner_id(), 5 * SEC)
        .await
        .unwrap();
    let retry_in = other.expect_err("another owner is refused");
    assert!(retry_in <= 5 * SEC, "{retry_in:?}");
    // Either handle releases: they are one lease.
    assert_eq!(
        issuer.release(&first).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert_eq!(
        issuer.release(&again).await.unwrap(),
        ReleaseOutcome::AlreadyExpired
    );
}

#[tokio::test]
async fn wait_acquire_gets_the_lock_when_it_frees_and_gives_up_on_time() {
    if skip("wait_acquire") {
        return;
    }
    let issuer = issuer().await;
    let resource = unique_resource("zk-wait");
    let held = issuer.acquire(&resource, SEC).await.unwrap().unwrap();
    let started = Instant::now();
    assert!(
        issuer
            .acquire_wait(&resource, SEC, Duration::from_millis(100))
            .await
            .unwrap()
            .is_none()
    );
    assert!(started.elapsed() >= Duration::from_millis(100));
    let next = issuer
        .acquire_wait(&resource, SEC, 10 * SEC)
        .await
        .unwrap()
        .expect("lock frees after TTL");
    assert!(next.token() > held.token());
    assert!(started.elapsed() < 6 * SEC, "{:?}", started.elapsed());
    // A release frees it at once for a waiter.
    let waiter = {
        let (issuer, resource) = (issuer.clone(), resource.clone());
        tokio::spawn(async move { issuer.acquire_wait(&resource, SEC, 10 * SEC).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let released_at = Instant::now();
    assert_eq!(
        issuer.release(&next).await.unwrap(),
        ReleaseOutcome::Released
    );
    let third = waiter.await.unwrap().unwrap().expect("freed by release");
    assert!(third.token() > next.token());
    assert!(released_at.elapsed() < SEC, "{:?}", released_at.elapsed());
}

#[tokio::test]
async fn bad_ttls_and_owners_are_refused_before_touching_zookeeper() {
    if skip("bad_ttls") {
        return;
    }
    let issuer = issuer().await;
    let resource = unique_resource("zk-bad-ttl");
    for ttl in [
        Duration::ZERO,
        Duration::from_millis(1),
        Duration::from_secs(400 * 24 * 3600),
    ] {
        assert!(
            matches!(
                issuer.acquire(&resource, ttl).await,
                Err(Error::InvalidDuration(_))
            ),
            "{ttl:?}"
        );
    }
    for owner in ["", "own:er"] {
        assert!(matches!(
            issuer.acquire_as(&resource, owner, SEC).await,
            Err(Error::InvalidOwner(_))
        ));
    }
    let status = issuer.status(&resource).await.unwrap();
    assert_eq!(status.owner, None, "nothing written");
    for url in [
        "redis://127.0.0.1:6379",
        "zk://",
        "zk://h/chroot",
        "zk://h?x=1",
    ] {
        assert!(
            matches!(
                ZkIssuer::connect(url).await,
                Err(Error::InvalidIssuerUrl(_))
            ),
            "{url}"
        );
    }
}

/// The lock's layout in ZooKeeper, tokens across resources, and a lock deleted by hand.
#[tokio::test]
async fn tokens_are_creation_zxids_and_compare_across_resources() {
    if skip("layout") {
        return;
    }
    let url = zk_url().await;
    let issuer = issuer().await;
    let raw = raw(&url).await;
    let one = unique_resource("zk-one");
    let two =
        Resource::in_domain("billing", &format!("account/{}", rand::random::<u32>())).unwrap();
    let a = issuer.acquire(&one, 5 * SEC).await.unwrap().unwrap();
    let b = issuer.acquire(&two, 5 * SEC).await.unwrap().unwrap();
    assert!(b.token() > a.token(), "one ensemble-wide zxid");
    assert_eq!(b.token().get() >> 32, a.token().get() >> 32, "same epoch");

    let dir = zk_lock_dir(&two);
    assert!(
        dir.starts_with("/pgfence/lock/{billing}account%2F"),
        "{dir}"
    );
    let (children, _) = raw.get_children(&dir).await.unwrap();
    assert_eq!(children.len(), 1, "one lock node: {children:?}");
    assert!(
        children[0].starts_with(&format!("lock-{}-", b.owner())),
        "{children:?}"
    );
    let node = format!("{dir}/{}", children[0]);
    let (data, stat) = raw.get_data(&node).await.unwrap();
    assert_eq!(data, b.owner().as_bytes());
    assert_eq!(stat.czxid, b.token().get(), "the token is the node's czxid");
    assert_eq!(
        stat.ephemeral_owner,
        issuer.session_id(),
        "ephemeral, of the issuer's session"
    );

    // An operator deletes A's lock and someone takes it: A is told so, and cannot free it.
    let dir_one = zk_lock_dir(&one);
    for child in raw.list_children(&dir_one).await.unwrap() {
        raw.delete(&format!("{dir_one}/{child}"), None)
            .await
            .unwrap();
    }
    assert_eq!(
        issuer.release(&a).await.unwrap(),
        ReleaseOutcome::AlreadyExpired
    );
    let c = issuer.acquire(&one, 5 * SEC).await.unwrap().unwrap();
    assert!(c.token() > b.token());
    let mut a = a;
    assert_eq!(
        issuer.release(&a).await.unwrap(),
        ReleaseOutcome::TakenByOther
    );
    assert_eq!(
        issuer.extend(&mut a, 5 * SEC).await.unwrap(),
        LeaseState::Taken
    );
    // A lease of the same owner with an older token is another lease.
    let stale = pgfence::Lease::resume(one.clone(), c.owner(), a.token());
    assert_eq!(
        issuer.release(&stale).await.unwrap(),
        ReleaseOutcome::TakenByOther
    );
    assert_eq!(issuer.release(&c).await.unwrap(), ReleaseOutcome::Released);
    assert_eq!(issuer.release(&b).await.unwrap(), ReleaseOutcome::Released);
    // Another process (another session) releases with owner and token alone, but cannot
    // extend a lock of this session.
    let d = issuer.acquire(&two, 5 * SEC).await.unwrap().unwrap();
    let other = ZkIssuer::connect(&url).await.unwrap();
    assert_ne!(other.session_id(), issuer.session_id());
    let mut resumed = pgfence::Lease::resume(two.clone(), d.owner(), d.token());
    assert!(matches!(
        other.extend(&mut resumed, 5 * SEC).await,
        Err(Error::InvalidOwner(_))
    ));
    assert_eq!(
        other.release(&resumed).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert!(raw.list_children(&dir).await.unwrap_or_default().is_empty());
    // Its own timer no longer deletes anything: a new holder keeps the lock past d's TTL.
    let e = other.acquire(&two, 10 * SEC).await.unwrap();
    let e = match e {
        Some(e) => e,
        None => panic!(
            "free, yet refused: {:?} {:?}",
            raw.list_children(&dir).await,
            other.status(&two).await
        ),
    };
    assert!(e.token() > d.token());
}

/// A holder whose process dies (here: its issuer and session are dropped) leaves no lock
/// behind once its session ends, whatever its lease's TTL.
#[tokio::test]
async fn a_dead_holders_lock_ends_with_its_session() {
    if skip("dead_holder") {
        return;
    }
    let url = format!("{}?session_timeout_ms=2000", zk_url().await);
    let resource = unique_resource("zk-dead");
    let dead = ZkIssuer::connect(&url).await.unwrap();
    let lease = dead.acquire(&resource, 600 * SEC).await.unwrap().unwrap();
    let issuer = issuer().await;
    assert!(
        issuer.acquire(&resource, SEC).await.unwrap().is_none(),
        "held"
    );
    let died = Instant::now();
    drop(dead);
    let next = issuer
        .acquire_wait(&resource, 5 * SEC, 15 * SEC)
        .await
        .unwrap()
        .expect("the dead holder's session ends");
    eprintln!("a dead holder's lock was free after {:?}", died.elapsed());
    assert!(next.token() > lease.token());
    assert_eq!(
        issuer.release(&next).await.unwrap(),
        ReleaseOutcome::Released
    );
}

#[derive(Clone, sqlx::FromRow)]
struct Snapshot {
    sku: String,
    payload: String,
}
pgfence::fenced_table!(Snapshot { table: "zk_snapshot", key: sku: String, columns: [payload] });

async fn snapshot_table() -> (TestDb, Repository<Snapshot>) {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE zk_snapshot (sku text PRIMARY KEY, payload text NOT NULL); INSERT INTO zk_snapshot VALUES ('A-1', 'initial');").await;
    pgfence::guard(&db.pool, &TableName::parse("zk_snapshot").unwrap())
        .await
        .unwrap();
    let repo = Repository::<Snapshot>::new(db.pool.clone()).unwrap();
    (db, repo)
}

fn row(payload: &str) -> Snapshot {
    Snapshot {
        sku: "A-1".into(),
        payload: payload.into(),
    }
}

/// A holder paused past its TTL writes after the next holder: Postgres rejects it.
#[tokio::test]
async fn paused_holder_is_fenced_by_postgres() {
    if skip("paused_holder") {
        return;
    }
    let (db, repo) = snapshot_table().await;
    let issuer = issuer().await;
    let resource = unique_resource("zk-inventory");
    let a = issuer.acquire(&resource, SEC).await.unwrap().unwrap();
    let _: Snapshot = repo.claim(&db.pool, &a, &"A-1".to_owned()).await.unwrap();
    // A pauses; its lease runs out and B takes the lock.
    let b = issuer
        .acquire_wait(&resource, 5 * SEC, 10 * SEC)
        .await
        .unwrap()
        .expect("A's lease expires");
    repo.update(&db.pool, &b, &row("B")).await.unwrap();
    let err = repo.update(&db.pool, &a, &row("A")).await.unwrap_err();
    assert!(
        matches!(err, Error::StaleToken { presented, current, .. } if presented == a.token().get() && current == b.token().get()),
        "{err:?}"
    );
    let payload: String = sqlx::query_scalar("SELECT payload FROM zk_snapshot")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(payload, "B");
    assert_eq!(
        issuer.release(&a).await.unwrap(),
        ReleaseOutcome::TakenByOther
    );
    assert_eq!(issuer.release(&b).await.unwrap(), ReleaseOutcome::Released);
}

/// One acquisition in the failover run: when it was asked for, when it was granted, its token.
struct Grant {
    started: Instant,
    finished: Instant,
    resource: usize,
    token: i64,
}

/// A 3-server ensemble loses its leader mid-run: every token issued after the failover is above
/// every token issued before it (≥ 1,000 acquisitions each side), and a holder paused across
/// the failover is fenced by Postgres.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_failover_keeps_tokens_increasing() {
    if !zk_installed() {
        eprintln!(
            "SKIPPED leader_failover: ZooKeeper is not installed (Debian: apt-get install zookeeper)"
        );
        return;
    }
    const WORKERS: usize = 8;
    const EACH_SIDE: usize = 1000;
    let test_started = Instant::now();
    let mut cluster = ZkEnsemble::start(3)
        .await
        .expect("start a 3-server ZooKeeper");
    let (db, repo) = snapshot_table().await;
    let issuer = ZkIssuer::connect(&cluster.url()).await.unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let transient = Arc::new(AtomicUsize::new(0));
    let grants = Arc::new(std::sync::Mutex::new(Vec::<Grant>::new()));
    let resources: Vec<Resource> = (0..WORKERS)
        .map(|i| unique_resource(&format!("zk-failover-{i}")))
        .collect();
    let mut workers = Vec::new();
    for (i, resource) in resources.iter().cloned().enumerate() {
        let (issuer, stop, transient, grants) = (
            issuer.clone(),
            stop.clone(),
            transient.clone(),
            grants.clone(),
        );
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let started = Instant::now();
                match issuer.acquire(&resource, 2 * SEC).await {
                    Ok(Some(lease)) => {
                        let finished = Instant::now();
                        grants.lock().unwrap().push(Grant {
                            started,
                            finished,
                            resource: i,
                            token: lease.token().get(),
                        });
                        // A release that fails in transit leaves the lock to expire (2 s).
                        match issuer.release(&lease).await {
                            Ok(state) => assert_eq!(state, ReleaseOutcome::Released),
                            Err(e) if e.is_retryable() => {
                                transient.fetch_add(1, Ordering::SeqCst);
                            }
                            Err(e) => panic!("release: {e}"),
                        }
                    }
                    // Held: a release that failed in transit left the lock to expire.
                    Ok(None) => tokio::time::sleep(Duration::from_millis(20)).await,
                    Err(e) if e.is_retryable() => {
                        transient.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(e) => panic!("acquire: {e}"),
                }
            }
        }));
    }
    let count = || grants.lock().unwrap().len();
    let deadline = Instant::now() + Duration::from_secs(30);
    while count() < EACH_SIDE {
        assert!(
            Instant::now() < deadline,
            "only {} acquisitions in 30 s",
            count()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // A holder that will be paused across the failover claims the row.
    let zombie_resource = unique_resource("zk-failover-zombie");
    let zombie = issuer
        .acquire(&zombie_resource, SEC)
        .await
        .unwrap()
        .unwrap();
    let _: Snapshot = repo
        .claim(&db.pool, &zombie, &"A-1".to_owned())
        .await
        .unwrap();

    let old_leader = cluster.leader().expect("a leader");
    let killed_at = Instant::now();
    let before_kill = count();
    cluster.kill(old_leader).unwrap();
    let new_leader = loop {
        if let Some(l) = cluster.leader().filter(|l| *l != old_leader) {
            break l;
        }
        assert!(killed_at.elapsed() < 20 * SEC, "no new leader after 20 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let elected_after = killed_at.elapsed();

    let after = |grants: &[Grant]| grants.iter().filter(|g| g.started > killed_at).count();
    let deadline = Instant::now() + Duration::from_secs(30);
    while after(&grants.lock().unwrap()) < EACH_SIDE {
        assert!(
            Instant::now() < deadline,
            "only {} acquisitions after the failover in 30 s",
            after(&grants.lock().unwrap())
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.await.unwrap();
    }

    // The paused holder wakes up after the failover: the next holder wrote first.
    let next = issuer
        .acquire_wait(&zombie_resource, 5 * SEC, 15 * SEC)
        .await
        .unwrap()
        .expect("the paused holder's lease expires");
    assert!(next.token() > zombie.token());
    repo.update(&db.pool, &next, &row("after failover"))
        .await
        .unwrap();
    let err = repo
        .update(&db.pool, &zombie, &row("zombie"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::StaleToken { presented, current, .. } if presented == zombie.token().get() && current == next.token().get()),
        "{err:?}"
    );

    assert_eq!(
        issuer.release(&next).await.unwrap(),
        ReleaseOutcome::Released
    );

    // The killed member rejoins; tokens keep rising.
    cluster.restart(old_leader).await.unwrap();
    let last = issuer.acquire(&zombie_resource, SEC).await;

    let grants = grants.lock().unwrap();
    let before: Vec<&Grant> = grants.iter().filter(|g| g.finished < killed_at).collect();
    let after: Vec<&Grant> = grants.iter().filter(|g| g.started > killed_at).collect();
    let max_before = before.iter().map(|g| g.token).max().unwrap();
    let min_after = after.iter().map(|g| g.token).min().unwrap();
    let first_after = after
        .iter()
        .map(|g| g.finished.duration_since(killed_at))
        .min()
        .unwrap();
    let unique: HashSet<i64> = grants.iter().map(|g| g.token).collect();
    assert_eq!(unique.len(), grants.len(), "every token issued once");
    let mut per_resource: BTreeMap<usize, Vec<(Instant, i64)>> = BTreeMap::new();
    for g in grants.iter() {
        per_resource
            .entry(g.resource)
            .or_default()
            .push((g.finished, g.token));
    }
    for tokens in per_resource.values_mut() {
        tokens.sort();
        assert!(
            tokens.windows(2).all(|w| w[0].1 < w[1].1),
            "per resource, tokens rise"
        );
    }
    // Stall around the kill: the longest gap between grants.
    let mut finished: Vec<Instant> = grants.iter().map(|g| g.finished).collect();
    finished.sort();
    let longest_gap = finished
        .windows(2)
        .map(|w| w[1].duration_since(w[0]))
        .max()
        .unwrap();
    eprintln!(
        "ZooKeeper failover: {} acquisitions before the kill (max token {max_before}), {} after \
         (min token {min_after}), {} in flight across it; {} transient errors retried\n  \
         killed leader m{old_leader} ({before_kill} grants so far); new leader m{new_leader} \
         reported after {elected_after:?}; first acquisition asked after the kill granted \
         {first_after:?} after it; longest gap between grants {longest_gap:?}; test took {:?}",
        before.len(),
        after.len(),
        grants.len() - before.len() - after.len(),
        transient.load(Ordering::SeqCst),
        test_started.elapsed(),
    );
    assert!(before.len() >= EACH_SIDE && after.len() >= EACH_SIDE);
    assert!(
        min_after > max_before,
        "a token after the failover ({min_after}) is not above one before it ({max_before})"
    );
    assert!(
        min_after >> 32 > max_before >> 32,
        "the new leader's epoch ({}) is above the old one's ({})",
        min_after >> 32,
        max_before >> 32
    );
    let last = last.unwrap().expect("released");
    assert!(last.token().get() > min_after);
}
