//! The lease-semantics tests every issuer shares: one suite, run against Redis (`issuer.rs`,
//! standalone and through Sentinel, and `lease_semantics` in `issuer_trait.rs`), PostgreSQL
//! (`pg_issuer.rs`), etcd (`etcd_issuer.rs`) and ZooKeeper (`zk_issuer.rs`), each function
//! generic over the issuer ([`TokenIssuer`]) and told by a [`Profile`] where the issuers really
//! differ.
//!
//! A test module invokes [`lease_tests!`] once per issuer (a second one in a module of its
//! own), which defines there the `#[tokio::test]` functions of the tests whose names the
//! modules share, each asking the module's `skip` (which goes through the testkit's one skip
//! mechanism, [`pgfence_testkit::needs`], for an optional server) and run on the module's
//! issuer.
//! The modules call the rest themselves: the bad-TTL test
//! (named after the issuer, with their URL checks after it), the layout tests (after a lock
//! deleted by hand: [`deleted_lock_is_lost_to_its_holder`]), [`lease_semantics`] through
//! `Arc<dyn TokenIssuer>`, [`floor_and_recovery_are_no_ops`], [`key_prefixes_separate_locks`]
//! and, for the consensus stores, the leader failover (the cluster's operations through
//! [`Cluster`]).
//!
//! A module of the `issuers` test binary (`tests/issuers/main.rs`), next to the issuers' test
//! modules that use it.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::time::Duration;

use pgfence::{
    Error, Lease, Repository, Resource, TokenIssuer,
    issuer::{IssuerOptions, KeepAlive, LeaseState, ReleaseOutcome, connect_issuer_with},
    table::TableName,
};
use pgfence_testkit::optional::OptionalServer;
use pgfence_testkit::{Installed, needs};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::support::{TestDb, unique_resource};

const SEC: Duration = Duration::from_secs(1);

/// The TTL of a lease meant to run out during a test.
const SHORT: Duration = Duration::from_millis(300);

/// Where the issuers differ, as far as these tests can tell.
pub struct Profile {
    /// Starts the test resources' names: `etcd`, `zk`.
    pub name: &'static str,
    /// Names the issuer in printed figures: `etcd`, `ZooKeeper`.
    pub label: &'static str,
    /// The unit the server keeps TTLs in, rounding up (at least one unit): whole seconds for
    /// etcd leases; zero for ZooKeeper, whose TTLs are the issuer's own timers, kept exactly.
    pub ttl_resolution: Duration,
    /// How long past its TTL as the server keeps it a lock may still be held when a waiter
    /// gets it (expiry checks, the waiter's backoff, a slow machine). For etcd it also covers
    /// a cluster that raises short leases to its minimum lease TTL (1–2 s).
    pub expiry_slack: Duration,
    /// Whether another owner refused by `acquire_as` is told the holder's remaining TTL (etcd,
    /// in whole seconds) rather than zero ("unknown": ZooKeeper).
    pub reports_retry_in: bool,
    /// Whether `status().counter` is the last token issued (a per-resource or per-domain
    /// counter: Redis, PostgreSQL) rather than a store-wide revision that the release moved
    /// past it (etcd, ZooKeeper).
    pub counter_is_last_token: bool,
}

impl Profile {
    /// The TTL the server keeps for `ttl`.
    fn server_ttl(&self, ttl: Duration) -> Duration {
        let unit = self.ttl_resolution.as_millis();
        if unit == 0 {
            return ttl;
        }
        let millis = ttl.as_millis().div_ceil(unit).max(1) * unit;
        Duration::from_millis(u64::try_from(millis).unwrap())
    }

    /// The longest a waiter may wait for a lock taken for `ttl` just before it started.
    fn expires_within(&self, ttl: Duration) -> Duration {
        self.server_ttl(ttl) + self.expiry_slack
    }
}

/// The URL of the server a test binary's single-server tests share: `env`'s value when set,
/// else the URL of the throwaway server `start` starts (kept in `cell` for the binary's life).
pub async fn shared_url<S: Send + Sync>(
    cell: &'static OnceCell<(String, Option<S>)>,
    env: &str,
    start: impl Future<Output = (String, S)>,
) -> String {
    cell.get_or_init(|| async {
        match std::env::var(env) {
            Ok(url) if !url.is_empty() => (url, None),
            _ => {
                let (url, server) = start.await;
                (url, Some(server))
            }
        }
    })
    .await
    .0
    .clone()
}

/// How a test binary's shared optional server is reached: `None` when the URL environment
/// variable names a running one, else the proof that the throwaway one can be started.
pub type Shared<S> = Option<Installed<S>>;

/// `Some` when `test` can run on the shared server of `S`: `env` names a running one, or `S`
/// is installed (the testkit's [`needs`], which prints the skip line otherwise).
pub fn external_or_needs<S: OptionalServer>(env: &str, test: &str) -> Option<Shared<S>> {
    if std::env::var(env).is_ok_and(|url| !url.is_empty()) {
        return Some(None);
    }
    needs::<S>(test).map(Some)
}

/// The proof a throwaway shared server starts with: there whenever `env` is unset (the start
/// future of [`shared_url`] is awaited only then).
pub fn proof<S>(shared: Shared<S>, env: &str) -> Installed<S> {
    shared.unwrap_or_else(|| panic!("{env} is unset, yet the skip check found it set"))
}

/// Defines the suite's shared `#[tokio::test]` functions in the invoking test file:
/// `lease_tests!(PROFILE, skip, issuer)`, where `skip(test: &str) -> Option<T>` is `None` for a
/// skipped test (after the testkit's skip line) and `issuer(t: T)` connects a fresh issuer
/// (each test has its own runtime).
macro_rules! lease_tests {
    ($profile:expr, $skip:ident, $issuer:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn concurrent_acquisitions_are_exclusive_and_strictly_increasing() {
            if let Some(have) = $skip("concurrent_acquisitions") {
                let issuer = $issuer(have).await;
                $crate::issuer_suite::concurrent_acquisitions_are_exclusive_and_strictly_increasing(
                                                                            &$profile, issuer,
                                                                        )
                                                                        .await;
            }
        }

        #[tokio::test]
        async fn expired_lease_cannot_release_or_extend_the_next_holders_lock() {
            if let Some(have) = $skip("expired_lease") {
                let issuer = $issuer(have).await;
                $crate::issuer_suite::expired_lease_cannot_release_or_extend_the_next_holders_lock(
                    &$profile, issuer,
                )
                .await;
            }
        }

        #[tokio::test]
        async fn owner_extend_keeps_the_lock_past_its_ttl() {
            if let Some(have) = $skip("owner_extend") {
                let issuer = $issuer(have).await;
                $crate::issuer_suite::owner_extend_keeps_the_lock_past_its_ttl(&$profile, issuer)
                    .await;
            }
        }

        #[tokio::test]
        async fn retried_acquire_by_the_same_owner_returns_the_same_token() {
            if let Some(have) = $skip("retried_acquire") {
                let issuer = $issuer(have).await;
                $crate::issuer_suite::retried_acquire_by_the_same_owner_returns_the_same_token(
                    &$profile, issuer,
                )
                .await;
            }
        }

        #[tokio::test]
        async fn wait_acquire_gets_the_lock_when_it_frees_and_gives_up_on_time() {
            if let Some(have) = $skip("wait_acquire") {
                let issuer = $issuer(have).await;
                $crate::issuer_suite::wait_acquire_gets_the_lock_when_it_frees_and_gives_up_on_time(
                                                                            &$profile, issuer,
                                                                        )
                                                                        .await;
            }
        }

        #[tokio::test]
        async fn paused_holder_is_fenced_by_postgres() {
            if let Some(have) = $skip("paused_holder") {
                let issuer = $issuer(have).await;
                $crate::issuer_suite::paused_holder_is_fenced_by_postgres(&$profile, issuer).await;
            }
        }
    };
}
pub(crate) use lease_tests;

/// The cluster operations the failover test needs, from each issuer's test server.
pub trait Cluster {
    /// The member every running member names as leader; `None` during an election.
    async fn find_leader(&self) -> Option<usize>;
    /// Kills member `i` (its data stays, for [`Cluster::restart_member`]).
    fn kill_member(&mut self, i: usize);
    /// Starts killed member `i` again.
    async fn restart_member(&mut self, i: usize);
}

/// 8 tasks × 40 acquisitions of one lock: one holder at a time, tokens strictly increase in
/// grant order.
pub async fn concurrent_acquisitions_are_exclusive_and_strictly_increasing<I>(
    p: &Profile,
    issuer: I,
) where
    I: TokenIssuer + Clone,
{
    let resource = unique_resource(&format!("{}-contended", p.name));
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
    if p.counter_is_last_token {
        assert_eq!(status.counter, *granted.last().unwrap(), "{status:?}");
    } else {
        assert!(status.counter > *granted.last().unwrap(), "{status:?}");
    }
}

/// A lease that ran out cannot release or extend the next holder's lock; the lock ends no
/// sooner than the TTL the server keeps (etcd: whole seconds) and not much later.
pub async fn expired_lease_cannot_release_or_extend_the_next_holders_lock<I: TokenIssuer>(
    p: &Profile,
    issuer: I,
) {
    let resource = unique_resource(&format!("{}-expiry", p.name));
    let taken = Instant::now();
    let mut a = issuer.acquire(&resource, SHORT).await.unwrap().unwrap();
    assert!(
        issuer.acquire(&resource, SEC).await.unwrap().is_none(),
        "held by A"
    );
    let b = issuer
        .acquire_wait(&resource, 10 * SEC, 10 * SEC)
        .await
        .unwrap()
        .expect("A's lease expires");
    let waited = taken.elapsed();
    assert!(
        waited >= p.server_ttl(SHORT) && waited < p.expires_within(SHORT),
        "a {SHORT:?} lease ({:?} on the server) ended after {waited:?}",
        p.server_ttl(SHORT)
    );
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

/// The owner's extends keep the lock past its TTL, with the same token.
pub async fn owner_extend_keeps_the_lock_past_its_ttl<I: TokenIssuer>(p: &Profile, issuer: I) {
    let resource = unique_resource(&format!("{}-extend", p.name));
    let mut lease = issuer.acquire(&resource, SEC).await.unwrap().unwrap();
    let token = lease.token();

    // Same TTL (etcd: a keep-alive of its lease).
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

    // Another TTL (etcd: the key moves to a new lease): the token stays.
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

/// The same owner gets the same token again; another owner is refused with a `retry_in` as
/// the issuer reports it.
pub async fn retried_acquire_by_the_same_owner_returns_the_same_token<I: TokenIssuer>(
    p: &Profile,
    issuer: I,
) {
    let resource = unique_resource(&format!("{}-retry", p.name));
    let owner = pgfence::Lease::new_owner_id();
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
        .acquire_as(&resource, &pgfence::Lease::new_owner_id(), 5 * SEC)
        .await
        .unwrap();
    let retry_in = other.expect_err("another owner is refused");
    if p.reports_retry_in {
        assert!(
            (SEC..=5 * SEC).contains(&retry_in) && p.server_ttl(retry_in) == retry_in,
            "the holder's remaining TTL, in the server's unit: {retry_in:?}"
        );
    } else {
        assert_eq!(retry_in, Duration::ZERO, "unknown");
    }
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

/// A waiting acquire gives up on time, gets the lock once its TTL runs out, and gets it at
/// once when the holder releases it.
pub async fn wait_acquire_gets_the_lock_when_it_frees_and_gives_up_on_time<I>(
    p: &Profile,
    issuer: I,
) where
    I: TokenIssuer + Clone,
{
    let resource = unique_resource(&format!("{}-wait", p.name));
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
    assert!(
        started.elapsed() < p.expires_within(SEC),
        "{:?}",
        started.elapsed()
    );
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

/// Bad TTLs and owner ids are refused before anything is written (the test files then check
/// their issuer's URL parsing).
pub async fn bad_ttls_and_owners_are_refused<I: TokenIssuer>(p: &Profile, issuer: I) {
    let resource = unique_resource(&format!("{}-bad-ttl", p.name));
    for ttl in [
        Duration::ZERO,
        Duration::from_millis(1),
        Duration::from_secs(400 * 24 * 3600),
    ] {
        assert!(
            matches!(
                issuer.acquire(&resource, ttl).await,
                Err(Error::Invalid(pgfence::error::InvalidInput::Duration(_)))
            ),
            "{ttl:?}"
        );
    }
    for owner in ["", "own:er"] {
        assert!(matches!(
            issuer.acquire_as(&resource, owner, SEC).await,
            Err(Error::Invalid(pgfence::error::InvalidInput::Owner(_)))
        ));
    }
    let status = issuer.status(&resource).await.unwrap();
    assert_eq!(status.owner, None, "nothing written");
}

/// After an operator deleted `a`'s lock on `one` by hand (the layout tests do, with a raw
/// client): `a` is told so, and once someone takes the lock, `a` cannot free or extend it,
/// nor can a lease of the new holder's owner with `a`'s older token. Releases the new holder
/// and `b`.
pub async fn deleted_lock_is_lost_to_its_holder<I: TokenIssuer>(
    issuer: &I,
    one: &Resource,
    mut a: Lease,
    b: &Lease,
) {
    assert_eq!(
        issuer.release(&a).await.unwrap(),
        ReleaseOutcome::AlreadyExpired
    );
    let c = issuer.acquire(one, 5 * SEC).await.unwrap().unwrap();
    assert!(c.token() > b.token());
    assert_eq!(
        issuer.release(&a).await.unwrap(),
        ReleaseOutcome::TakenByOther
    );
    assert_eq!(
        issuer.extend(&mut a, 5 * SEC).await.unwrap(),
        LeaseState::Taken
    );
    // A lease of the same owner with an older token is another lease.
    let stale = Lease::resume(one.clone(), c.owner(), a.token());
    assert_eq!(
        issuer.release(&stale).await.unwrap(),
        ReleaseOutcome::TakenByOther
    );
    assert_eq!(issuer.release(&c).await.unwrap(), ReleaseOutcome::Released);
    assert_eq!(issuer.release(b).await.unwrap(), ReleaseOutcome::Released);
}

#[derive(Clone, sqlx::FromRow)]
struct Snapshot {
    sku: String,
    payload: String,
}
pgfence::fenced_table!(Snapshot { table: "issuer_snapshot", key: sku: String, columns: [payload] });

async fn snapshot_table() -> (TestDb, Repository<Snapshot>) {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE issuer_snapshot (sku text PRIMARY KEY, payload text NOT NULL); INSERT INTO issuer_snapshot VALUES ('A-1', 'initial');").await;
    pgfence::guard::guard(&db.pool, &TableName::parse("issuer_snapshot").unwrap())
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
pub async fn paused_holder_is_fenced_by_postgres<I: TokenIssuer>(p: &Profile, issuer: I) {
    let (db, repo) = snapshot_table().await;
    let resource = unique_resource(&format!("{}-inventory", p.name));
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
    let payload: String = sqlx::query_scalar("SELECT payload FROM issuer_snapshot")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(payload, "B");
    // The rejection is audited with the lease's holder and name.
    let audit = pgfence::audit::list(&db.pool, &Default::default())
        .await
        .unwrap();
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(audit[0].holder.as_deref(), Some(a.owner()));
    assert_eq!(
        audit[0].resource.as_deref(),
        Some(a.fencing_resource().as_str())
    );
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

/// `cluster` (3 members, `issuer` on all of them) loses its leader mid-run: every token issued
/// after the failover is above every token issued before it (≥ 1,000 acquisitions each side),
/// tokens rise per resource, and a holder paused across the failover is fenced by Postgres.
/// Prints the figures (`test_started`: when the test began, cluster start-up included).
/// Returns the largest token granted before the kill and the smallest asked for after it.
pub async fn leader_failover_keeps_tokens_increasing<I, C>(
    p: &Profile,
    issuer: I,
    cluster: &mut C,
    test_started: Instant,
) -> (i64, i64)
where
    I: TokenIssuer + Clone,
    C: Cluster,
{
    const WORKERS: usize = 8;
    const EACH_SIDE: usize = 1000;
    let (db, repo) = snapshot_table().await;

    let stop = Arc::new(AtomicBool::new(false));
    let transient = Arc::new(AtomicUsize::new(0));
    let grants = Arc::new(std::sync::Mutex::new(Vec::<Grant>::new()));
    let resources: Vec<Resource> = (0..WORKERS)
        .map(|i| unique_resource(&format!("{}-failover-{i}", p.name)))
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
    let zombie_resource = unique_resource(&format!("{}-failover-zombie", p.name));
    let zombie = issuer
        .acquire(&zombie_resource, SEC)
        .await
        .unwrap()
        .unwrap();
    let _: Snapshot = repo
        .claim(&db.pool, &zombie, &"A-1".to_owned())
        .await
        .unwrap();

    let old_leader = cluster.find_leader().await.expect("a leader");
    let killed_at = Instant::now();
    let before_kill = count();
    cluster.kill_member(old_leader);
    // Acquisitions asked for before the old leader was gone may still have been committed by
    // it: "after the failover" starts once it is dead.
    let dead_at = Instant::now();
    let new_leader = loop {
        if let Some(l) = cluster.find_leader().await.filter(|l| *l != old_leader) {
            break l;
        }
        // A loaded CI host can take this long to elect (3 JVMs on 2 cores): the bound is the
        // test environment's, the assertions below are the feature's.
        assert!(killed_at.elapsed() < 45 * SEC, "no new leader after 45 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let elected_after = killed_at.elapsed();

    let after = |grants: &[Grant]| grants.iter().filter(|g| g.started > dead_at).count();
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
    cluster.restart_member(old_leader).await;
    let last = issuer.acquire(&zombie_resource, SEC).await;

    let grants = grants.lock().unwrap();
    let before: Vec<&Grant> = grants.iter().filter(|g| g.finished < killed_at).collect();
    let after: Vec<&Grant> = grants.iter().filter(|g| g.started > dead_at).collect();
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
        "{} failover: {} acquisitions before the kill (max token {max_before}), {} after \
         (min token {min_after}), {} in flight across it; {} transient errors retried\n  \
         killed leader m{old_leader} ({before_kill} grants so far); new leader m{new_leader} \
         reported after {elected_after:?}; first acquisition asked after the kill granted \
         {first_after:?} after it; longest gap between grants {longest_gap:?}; test took {:?}",
        p.label,
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
    let last = last.unwrap().expect("released");
    assert!(last.token().get() > min_after);
    (max_before, min_after)
}

/// The lease semantics every issuer shares, checked through `Arc<dyn TokenIssuer>` (as a CLI
/// or a service that picks its issuer from a URL holds it). `short` is a TTL the issuer
/// expires quickly (etcd rounds TTLs up to whole seconds and has a minimum of its own);
/// `expire_wait` is long enough for a lease of `short` to run out.
pub async fn lease_semantics(issuer: Arc<dyn TokenIssuer>, short: Duration, expire_wait: Duration) {
    let resource = unique_resource("trait");

    // Acquire, exclusive while held.
    let mut a = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
    assert!(issuer.acquire(&resource, 10 * SEC).await.unwrap().is_none());
    let retry_in = issuer
        .acquire_as(&resource, "someone-else", 10 * SEC)
        .await
        .unwrap()
        .unwrap_err();
    assert!(retry_in <= 10 * SEC, "{retry_in:?}");
    // The same owner again: the same token (an idempotent retry).
    let again = issuer
        .acquire_as(&resource, a.owner(), 10 * SEC)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.token(), a.token());

    // Status names the holder.
    let status = issuer.status(&resource).await.unwrap();
    assert_eq!(status.owner.as_deref(), Some(a.owner()));
    assert_eq!(status.token, Some(a.token().get()));
    assert!(status.counter >= a.token().get());

    // Extend: still held.
    assert_eq!(
        issuer.extend(&mut a, 20 * SEC).await.unwrap(),
        LeaseState::Held
    );
    assert!(a.remaining() > 10 * SEC);

    // Release: released, then already expired (nobody holds it).
    assert_eq!(issuer.release(&a).await.unwrap(), ReleaseOutcome::Released);
    assert_eq!(
        issuer.release(&a).await.unwrap(),
        ReleaseOutcome::AlreadyExpired
    );
    assert_eq!(
        issuer.extend(&mut a, 10 * SEC).await.unwrap(),
        LeaseState::Expired
    );

    // A newer lease: a larger token; the old handle is told the lock is another's.
    let b = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
    assert!(b.token() > a.token(), "{} > {}", b.token(), a.token());
    assert_eq!(
        issuer.release(&a).await.unwrap(),
        ReleaseOutcome::TakenByOther
    );
    assert_eq!(
        issuer.extend(&mut a, 10 * SEC).await.unwrap(),
        LeaseState::Taken
    );

    // acquire_wait gets the lock once the holder releases it.
    let waiter = {
        let issuer = issuer.clone();
        let resource = resource.clone();
        tokio::spawn(async move { issuer.acquire_wait(&resource, 10 * SEC, 10 * SEC).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(issuer.release(&b).await.unwrap(), ReleaseOutcome::Released);
    let c = waiter
        .await
        .unwrap()
        .unwrap()
        .expect("the waiter got the lock");
    assert!(c.token() > b.token());
    // A wait that runs out.
    assert!(
        issuer
            .acquire_wait(&resource, 10 * SEC, Duration::from_millis(100))
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(issuer.release(&c).await.unwrap(), ReleaseOutcome::Released);

    // A lease that is not renewed expires; one kept alive outlives its TTL.
    let lapsed = issuer.acquire(&resource, short).await.unwrap().unwrap();
    tokio::time::sleep(expire_wait).await;
    assert_eq!(
        issuer.release(&lapsed).await.unwrap(),
        ReleaseOutcome::AlreadyExpired
    );
    let kept = issuer.acquire(&resource, short).await.unwrap().unwrap();
    let keep = KeepAlive::spawn(issuer.clone(), kept.clone());
    tokio::time::sleep(expire_wait).await;
    assert!(keep.deadline().is_some(), "still held");
    assert_eq!(
        issuer.status(&resource).await.unwrap().token,
        Some(kept.token().get())
    );
    keep.stop();
    assert_eq!(
        issuer.release(&kept).await.unwrap(),
        ReleaseOutcome::Released
    );

    // Bad input is refused before anything is sent.
    assert!(matches!(
        issuer.acquire(&resource, Duration::ZERO).await,
        Err(Error::Invalid(pgfence::error::InvalidInput::Duration(_)))
    ));
    assert!(matches!(
        issuer.acquire_as(&resource, "", SEC).await,
        Err(Error::Invalid(pgfence::error::InvalidInput::Owner(_)))
    ));
}

/// An issuer whose counter never goes backwards ignores raise_floor and recover_from:
/// `counter` is `resource`'s counter before; a floor far above it is not raised, a bad floor
/// is refused, a stale-token error recovers nothing, and the next lease's token is above
/// `counter`. Returns the counter raise_floor reported (at least `counter`, far below the
/// floor), for the issuer's own check.
pub async fn floor_and_recovery_are_no_ops<I: TokenIssuer + ?Sized>(
    issuer: &I,
    resource: &Resource,
    counter: i64,
) -> i64 {
    let after = issuer.raise_floor(resource, i64::MAX / 2).await.unwrap();
    assert!(after >= counter && after < i64::MAX / 2, "{after}");
    assert!(matches!(
        issuer.raise_floor(resource, -1).await,
        Err(Error::Invalid(pgfence::error::InvalidInput::Token(_)))
    ));
    let stale = Error::StaleToken {
        target: pgfence::error::StaleTarget::Resource(resource.to_string()),
        presented: 1,
        current: i64::MAX / 2,
        other_counter: false,
    };
    assert!(!issuer.recover_from(&stale).await.unwrap());
    let lease = issuer.acquire(resource, 10 * SEC).await.unwrap().unwrap();
    assert!(lease.token().get() > counter);
    assert_eq!(
        issuer.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    after
}

/// Two key prefixes on one server: two locks for one resource. `a` is the file's issuer
/// under the prefix `app-a` (its key layout checked by the file); the one under `app-b` is
/// connected here, through the trait, to `url`.
pub async fn key_prefixes_separate_locks<I: TokenIssuer>(a: &I, url: &str, resource: &Resource) {
    let b = connect_issuer_with(url, IssuerOptions::new().key_prefix("app-b"))
        .await
        .unwrap();
    let la = a.acquire(resource, 10 * SEC).await.unwrap().unwrap();
    let lb = b.acquire(resource, 10 * SEC).await.unwrap().unwrap();
    assert!(a.acquire(resource, 10 * SEC).await.unwrap().is_none());
    // Under b's prefix the resource's lock is lb's: la's handle cannot touch it.
    assert_eq!(
        b.release(&la).await.unwrap(),
        ReleaseOutcome::TakenByOther,
        "not its lock"
    );
    assert_eq!(a.release(&la).await.unwrap(), ReleaseOutcome::Released);
    assert_eq!(b.release(&lb).await.unwrap(), ReleaseOutcome::Released);
}
