//! The etcd issuer (feature `etcd`) against real etcd: the lease semantics of the other issuers
//! (the shared suite in `issuer_suite`, run against ZooKeeper too), a paused holder fenced by
//! Postgres, and a 3-member cluster that loses its leader mid-run.
//!
//! Each test starts (or shares) throwaway etcd members from the installed `etcd` binary on
//! 127.0.0.1, and prints a message and passes when etcd is not installed. `PGFENCE_ETCD_URL`
//! (`etcd://host:port,...`) points the single-node tests at a running cluster instead.
#![cfg(feature = "etcd")]

use crate::issuer_suite;
use crate::support;

use std::time::Duration;

use issuer_suite::Shared;
use issuer_suite::{Cluster, Profile};
use pgfence::{
    Resource, connect_issuer,
    issuer::{EtcdIssuer, IssuerKind, ReleaseOutcome, etcd},
};
use pgfence_testkit::optional::Etcd;
use pgfence_testkit::{EtcdCluster, needs};
use support::unique_resource;
use tokio::sync::OnceCell;
use tokio::time::Instant;

const SEC: Duration = Duration::from_secs(1);

/// etcd keeps a lock's TTL as a lease of whole seconds (rounded up; a cluster may raise a short
/// one to its minimum lease TTL, 1–2 s), and tells a refused owner the holder's remaining TTL.
const ETCD: Profile = Profile {
    name: "etcd",
    label: "etcd",
    ttl_resolution: SEC,
    expiry_slack: Duration::from_secs(5),
    reports_retry_in: true,
    counter_is_last_token: false,
};

const ENV: &str = "PGFENCE_ETCD_URL";

/// `Some` when `test` can run: `PGFENCE_ETCD_URL` names a running server, or the throwaway one can be
/// started (the testkit's skip line otherwise).
pub(crate) fn needs_etcd(test: &str) -> Option<Shared<Etcd>> {
    issuer_suite::external_or_needs(ENV, test)
}

/// The URL of the etcd the single-node tests share (one throwaway member per test binary).
pub(crate) async fn etcd_url(etcd: Shared<Etcd>) -> String {
    static SINGLE: OnceCell<(String, Option<EtcdCluster>)> = OnceCell::const_new();
    issuer_suite::shared_url(&SINGLE, ENV, async {
        let etcd = issuer_suite::proof(etcd, ENV);
        let node = EtcdCluster::single(etcd)
            .await
            .expect("start throwaway etcd");
        (node.url(), node)
    })
    .await
}

/// An issuer on the shared etcd (one client per test: each test has its own runtime).
async fn issuer(etcd: Shared<Etcd>) -> EtcdIssuer {
    EtcdIssuer::connect(&etcd_url(etcd).await)
        .await
        .expect("connect to etcd")
}

/// A raw client on `url`'s first endpoint, to look under the issuer.
async fn raw(url: &str) -> etcd_client::Client {
    let first = url
        .trim_start_matches("etcd://")
        .split(',')
        .next()
        .unwrap()
        .to_owned();
    etcd_client::Client::connect([format!("http://{first}")], None)
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
issuer_suite::lease_tests!(ETCD, needs_etcd, issuer);

#[tokio::test]
async fn bad_ttls_and_owners_are_refused_before_touching_etcd() {
    let Some(etcd) = needs_etcd("bad_ttls") else {
        return;
    };
    issuer_suite::bad_ttls_and_owners_are_refused(&ETCD, issuer(etcd).await).await;
    assert!(EtcdIssuer::connect("redis://127.0.0.1:6379").await.is_err());
    assert!(EtcdIssuer::connect("etcd://").await.is_err());
}

/// The lease semantics of the other issuers, through `Arc<dyn TokenIssuer>` (as
/// `redis_through_the_trait` in `issuer_trait.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_through_the_trait() {
    let Some(etcd) = needs_etcd("etcd_through_the_trait") else {
        return;
    };
    let issuer = connect_issuer(&etcd_url(etcd).await).await.unwrap();
    assert_eq!(issuer.kind(), IssuerKind::Etcd);
    assert!(!issuer.kind().can_reseed());
    // etcd leases count whole seconds, with a server minimum of 2 s by default.
    issuer_suite::lease_semantics(issuer, SEC, 4 * SEC).await;
}

/// Revisions never go backwards: raise_floor and recover_from do nothing.
#[tokio::test]
async fn etcd_floor_and_recovery_are_no_ops() {
    let Some(etcd) = needs_etcd("etcd_floor_and_recovery_are_no_ops") else {
        return;
    };
    let issuer = connect_issuer(&etcd_url(etcd).await).await.unwrap();
    let resource = unique_resource("trait-etcd-floor");
    let revision = issuer.status(&resource).await.unwrap().counter;
    // The revision reported may have moved on with other keys: the suite checks its bounds.
    issuer_suite::floor_and_recovery_are_no_ops(&*issuer, &resource, revision).await;
}

/// Two prefixes on one etcd: two locks for one resource.
#[tokio::test]
async fn etcd_key_prefixes_separate_locks() {
    let Some(etcd) = needs_etcd("etcd_key_prefixes_separate_locks") else {
        return;
    };
    let url = etcd_url(etcd).await;
    let a = EtcdIssuer::connect(&url)
        .await
        .unwrap()
        .with_key_prefix("app-a")
        .unwrap();
    let resource = unique_resource("trait-etcd-prefix");
    assert_eq!(a.lock_key(&resource), format!("app-a/lock/{resource}"));
    issuer_suite::key_prefixes_separate_locks(&a, &url, &resource).await;
}

/// The lock's layout in etcd, tokens across resources, and a lock deleted by hand.
#[tokio::test]
async fn tokens_are_create_revisions_and_compare_across_resources() {
    let Some(etcd) = needs_etcd("layout") else {
        return;
    };
    let url = etcd_url(etcd).await;
    let issuer = issuer(etcd).await;
    let mut raw = raw(&url).await;
    let one = unique_resource("etcd-one");
    let two =
        Resource::in_domain("billing", &format!("account:{}", rand::random::<u32>())).unwrap();
    let a = issuer.acquire(&one, 5 * SEC).await.unwrap().unwrap();
    let b = issuer.acquire(&two, 5 * SEC).await.unwrap().unwrap();
    assert!(b.token() > a.token(), "one cluster-wide revision");

    let key = etcd::lock_key(&two);
    assert!(key.starts_with("pgfence/lock/{billing}account:"));
    let got = raw.get(key.as_str(), None).await.unwrap();
    let kv = &got.kvs()[0];
    assert_eq!(kv.value(), b.owner().as_bytes());
    assert_eq!(kv.create_revision(), b.token().get());
    assert_ne!(kv.lease(), 0, "the lock lives on an etcd lease");
    let ttl = raw.lease_time_to_live(kv.lease(), None).await.unwrap();
    assert!((1..=5).contains(&ttl.ttl()), "{}", ttl.ttl());

    // An operator deletes A's lock and someone takes it: A is told so, and cannot free it.
    raw.delete(etcd::lock_key(&one).as_str(), None)
        .await
        .unwrap();
    issuer_suite::deleted_lock_is_lost_to_its_holder(&issuer, &one, a, &b).await;
    // A resumed handle (another process) releases with owner and token alone.
    let d = issuer.acquire(&two, 5 * SEC).await.unwrap().unwrap();
    let resumed = pgfence::Lease::resume(two.clone(), d.owner(), d.token());
    assert_eq!(
        issuer.release(&resumed).await.unwrap(),
        ReleaseOutcome::Released
    );
}

/// A 3-member cluster loses its leader mid-run: every token issued after the failover is above
/// every token issued before it (≥ 1,000 acquisitions each side), and a holder paused across
/// the failover is fenced by Postgres.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_failover_keeps_tokens_increasing() {
    let Some(etcd) = needs::<Etcd>("leader_failover") else {
        return;
    };
    let test_started = Instant::now();
    let mut cluster = EtcdCluster::start(etcd, 3)
        .await
        .expect("start a 3-member etcd");
    let issuer = EtcdIssuer::connect(&cluster.url()).await.unwrap();
    issuer_suite::leader_failover_keeps_tokens_increasing(
        &ETCD,
        issuer,
        &mut cluster,
        test_started,
    )
    .await;
}

impl Cluster for EtcdCluster {
    /// The member every reachable member names as leader, through the status API.
    async fn find_leader(&self) -> Option<usize> {
        let mut views = Vec::new();
        for (i, member) in self.members().iter().enumerate() {
            if !member.is_running() {
                continue;
            }
            let options = etcd_client::ConnectOptions::new()
                .with_connect_timeout(Duration::from_millis(300))
                .with_timeout(Duration::from_millis(500));
            let Ok(mut client) =
                etcd_client::Client::connect([member.endpoint()], Some(options)).await
            else {
                continue;
            };
            if let Ok(status) = client.status().await {
                let id = status.header().map(etcd_client::ResponseHeader::member_id);
                views.push((i, id, status.leader()));
            }
        }
        let leader = views.first()?.2;
        if leader == 0 || views.iter().any(|v| v.2 != leader) {
            return None;
        }
        views.iter().find(|v| v.1 == Some(leader)).map(|v| v.0)
    }

    fn kill_member(&mut self, i: usize) {
        self.kill(i).unwrap();
    }

    async fn restart_member(&mut self, i: usize) {
        self.restart(i).await.unwrap();
    }
}
