//! The ZooKeeper issuer (feature `zk`) against real ZooKeeper: the lease semantics of the other
//! issuers (the shared suite in `issuer_suite`, run against etcd too), a paused holder fenced
//! by Postgres, a dead holder's lock ending with its session, and a 3-server ensemble that
//! loses its leader mid-run.
//!
//! Each test starts (or shares) throwaway ZooKeeper servers from the installed `zookeeper`
//! package on 127.0.0.1, and prints a message and passes when ZooKeeper is not installed.
//! `PGFENCE_ZK_URL` (`zk://host:port,...`) points the single-server tests at a running ensemble
//! instead.
#![cfg(feature = "zk")]

use crate::issuer_suite;
use crate::support;

use std::time::Duration;

use issuer_suite::Shared;
use issuer_suite::{Cluster, Profile};
use pgfence::{
    Error, Resource, connect_issuer,
    issuer::{IssuerKind, ReleaseOutcome, ZkIssuer, zk},
};
use pgfence_testkit::optional::ZooKeeper;
use pgfence_testkit::{ZkEnsemble, needs};
use support::unique_resource;
use tokio::sync::OnceCell;
use tokio::time::Instant;

const SEC: Duration = Duration::from_secs(1);

/// The issuer keeps a lock's TTL itself, to the millisecond (a timer per lease), and cannot
/// tell a refused owner the holder's remaining TTL (`retry_in` is zero).
const ZK: Profile = Profile {
    name: "zk",
    label: "ZooKeeper",
    ttl_resolution: Duration::ZERO,
    expiry_slack: Duration::from_secs(3),
    reports_retry_in: false,
    counter_is_last_token: false,
};

const ENV: &str = "PGFENCE_ZK_URL";

/// `Some` when `test` can run: `PGFENCE_ZK_URL` names a running server, or the throwaway one can be
/// started (the testkit's skip line otherwise).
pub(crate) fn needs_zk(test: &str) -> Option<Shared<ZooKeeper>> {
    issuer_suite::external_or_needs(ENV, test)
}

/// The URL of the ZooKeeper the single-server tests share (one throwaway server per binary).
pub(crate) async fn zk_url(zk: Shared<ZooKeeper>) -> String {
    static SINGLE: OnceCell<(String, Option<ZkEnsemble>)> = OnceCell::const_new();
    issuer_suite::shared_url(&SINGLE, ENV, async {
        let zk = issuer_suite::proof(zk, ENV);
        let node = ZkEnsemble::single(zk)
            .await
            .expect("start throwaway ZooKeeper");
        (node.url(), node)
    })
    .await
}

/// An issuer on the shared ZooKeeper (one session per test: each test has its own runtime).
async fn issuer(zk: Shared<ZooKeeper>) -> ZkIssuer {
    ZkIssuer::connect(&zk_url(zk).await)
        .await
        .expect("connect to ZooKeeper")
}

/// A raw client on `url`'s servers, to look under the issuer.
async fn raw(url: &str) -> zookeeper_client::Client {
    zookeeper_client::Client::connect(url.trim_start_matches("zk://"))
        .await
        .unwrap()
}

// The suite's shared tests, defined here by the macro with the names they always had:
// concurrent_acquisitions_are_exclusive_and_strictly_increasing,
// expired_lease_cannot_release_or_extend_the_next_holders_lock,
// owner_extend_keeps_the_lock_past_its_ttl,
// retried_acquire_by_the_same_owner_returns_the_same_token,
// wait_acquire_gets_the_lock_when_it_frees_and_gives_up_on_time,
// paused_holder_is_fenced_by_postgres.
issuer_suite::lease_tests!(ZK, needs_zk, issuer);

#[tokio::test]
async fn bad_ttls_and_owners_are_refused_before_touching_zookeeper() {
    let Some(zk) = needs_zk("bad_ttls") else {
        return;
    };
    issuer_suite::bad_ttls_and_owners_are_refused(&ZK, issuer(zk).await).await;
    for url in [
        "redis://127.0.0.1:6379",
        "zk://",
        "zk://h/chroot",
        "zk://h?x=1",
    ] {
        assert!(
            matches!(
                ZkIssuer::connect(url).await,
                Err(Error::Invalid(pgfence::error::InvalidInput::IssuerUrl(_)))
            ),
            "{url}"
        );
    }
}

/// The lease semantics of the other issuers, through `Arc<dyn TokenIssuer>` (as
/// `redis_through_the_trait` in `issuer_trait.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zk_through_the_trait() {
    let Some(zk) = needs_zk("zk_through_the_trait") else {
        return;
    };
    let issuer = connect_issuer(&zk_url(zk).await).await.unwrap();
    assert_eq!(issuer.kind(), IssuerKind::ZooKeeper);
    assert_eq!(issuer.kind().name(), "zk");
    assert!(!issuer.kind().can_reseed());
    // The issuer's own timer ends a lapsed lease: sub-second TTLs work.
    issuer_suite::lease_semantics(issuer, Duration::from_millis(300), SEC).await;
}

/// zxids never go backwards: raise_floor and recover_from do nothing.
#[tokio::test]
async fn zk_floor_and_recovery_are_no_ops() {
    let Some(zk) = needs_zk("zk_floor_and_recovery_are_no_ops") else {
        return;
    };
    let issuer = connect_issuer(&zk_url(zk).await).await.unwrap();
    let resource = unique_resource("trait-zk-floor");
    let first = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
    issuer.release(&first).await.unwrap();
    let counter = issuer.status(&resource).await.unwrap().counter;
    assert!(counter > first.token().get(), "the release's zxid");
    let after = issuer_suite::floor_and_recovery_are_no_ops(&*issuer, &resource, counter).await;
    assert_eq!(after, counter, "nothing raised");
}

/// Two prefixes on one ensemble: two locks for one resource.
#[tokio::test]
async fn zk_key_prefixes_separate_locks() {
    let Some(zk) = needs_zk("zk_key_prefixes_separate_locks") else {
        return;
    };
    let url = zk_url(zk).await;
    let a = ZkIssuer::connect(&url)
        .await
        .unwrap()
        .with_key_prefix("app-a")
        .unwrap();
    let resource = unique_resource("trait-zk-prefix");
    assert_eq!(a.lock_dir(&resource), format!("/app-a/lock/{resource}"));
    issuer_suite::key_prefixes_separate_locks(&a, &url, &resource).await;
}

/// The lock's layout in ZooKeeper, tokens across resources, and a lock deleted by hand.
#[tokio::test]
async fn tokens_are_creation_zxids_and_compare_across_resources() {
    let Some(zk) = needs_zk("layout") else {
        return;
    };
    let url = zk_url(zk).await;
    let issuer = issuer(zk).await;
    let raw = raw(&url).await;
    let one = unique_resource("zk-one");
    let two =
        Resource::in_domain("billing", &format!("account/{}", rand::random::<u32>())).unwrap();
    let a = issuer.acquire(&one, 5 * SEC).await.unwrap().unwrap();
    let b = issuer.acquire(&two, 5 * SEC).await.unwrap().unwrap();
    assert!(b.token() > a.token(), "one ensemble-wide zxid");
    assert_eq!(b.token().get() >> 32, a.token().get() >> 32, "same epoch");

    let dir = zk::lock_dir(&two);
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
    let dir_one = zk::lock_dir(&one);
    for child in raw.list_children(&dir_one).await.unwrap() {
        raw.delete(&format!("{dir_one}/{child}"), None)
            .await
            .unwrap();
    }
    issuer_suite::deleted_lock_is_lost_to_its_holder(&issuer, &one, a, &b).await;
    // Another process (another session) releases with owner and token alone, but cannot
    // extend a lock of this session.
    let d = issuer.acquire(&two, 5 * SEC).await.unwrap().unwrap();
    let other = ZkIssuer::connect(&url).await.unwrap();
    assert_ne!(other.session_id(), issuer.session_id());
    let mut resumed = pgfence::Lease::resume(two.clone(), d.owner(), d.token());
    assert!(matches!(
        other.extend(&mut resumed, 5 * SEC).await,
        Err(Error::Invalid(pgfence::error::InvalidInput::Owner(_)))
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
    let Some(zk) = needs_zk("dead_holder") else {
        return;
    };
    let url = format!("{}?session_timeout_ms=2000", zk_url(zk).await);
    let resource = unique_resource("zk-dead");
    let dead = ZkIssuer::connect(&url).await.unwrap();
    let lease = dead.acquire(&resource, 600 * SEC).await.unwrap().unwrap();
    let issuer = issuer(zk).await;
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

/// A 3-server ensemble loses its leader mid-run: every token issued after the failover is above
/// every token issued before it (≥ 1,000 acquisitions each side) and in a later zxid epoch, and
/// a holder paused across the failover is fenced by Postgres.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_failover_keeps_tokens_increasing() {
    let Some(zk) = needs::<ZooKeeper>("leader_failover") else {
        return;
    };
    let test_started = Instant::now();
    let mut cluster = ZkEnsemble::start(zk, 3)
        .await
        .expect("start a 3-server ZooKeeper");
    let issuer = ZkIssuer::connect(&cluster.url()).await.unwrap();
    let (max_before, min_after) = issuer_suite::leader_failover_keeps_tokens_increasing(
        &ZK,
        issuer,
        &mut cluster,
        test_started,
    )
    .await;
    assert!(
        min_after >> 32 > max_before >> 32,
        "the new leader's epoch ({}) is above the old one's ({})",
        min_after >> 32,
        max_before >> 32
    );
}

impl Cluster for ZkEnsemble {
    /// The one running server whose mode is `leader`, through the servers' admin commands.
    async fn find_leader(&self) -> Option<usize> {
        self.leader()
    }

    fn kill_member(&mut self, i: usize) {
        self.kill(i).unwrap();
    }

    async fn restart_member(&mut self, i: usize) {
        self.restart(i).await.unwrap();
    }
}
