//! The lease semantics every issuer shares, checked through `Arc<dyn TokenIssuer>` (as a CLI
//! or a service that picks its issuer from a URL holds it): Redis always, etcd with the `etcd`
//! feature and ZooKeeper with the `zk` feature (each skipped, with a message, when its server
//! is not installed). Also the key prefixes.

mod support;

use std::sync::Arc;
use std::time::Duration;

use pgfence::{
    Error, Issuer, IssuerKind, IssuerOptions, KeepAlive, LeaseState, ReleaseOutcome, Resource,
    TokenIssuer, connect_issuer, connect_issuer_with,
};
use redis::AsyncCommands;
use support::{TestDb, redis_url, unique_resource};
use tokio::time::Instant;

const SEC: Duration = Duration::from_secs(1);

/// The checks, on any issuer. `short` is a TTL the issuer expires quickly (etcd rounds TTLs
/// up to whole seconds and has a minimum of its own).
async fn lease_semantics(issuer: Arc<dyn TokenIssuer>, short: Duration, expire_wait: Duration) {
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
        Err(Error::InvalidDuration(_))
    ));
    assert!(matches!(
        issuer.acquire_as(&resource, "", SEC).await,
        Err(Error::InvalidOwner(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_through_the_trait() {
    let issuer = connect_issuer(&redis_url().await).await.unwrap();
    assert_eq!(issuer.kind(), IssuerKind::Redis);
    assert!(issuer.kind().can_reseed());
    lease_semantics(
        issuer,
        Duration::from_millis(300),
        Duration::from_millis(700),
    )
    .await;
}

/// Redis's counter can go backwards, so raise_floor / recover_from / reseed act on it.
#[tokio::test]
async fn redis_floor_and_recovery_through_the_trait() {
    let db = TestDb::new().await;
    let issuer: Arc<dyn TokenIssuer> = Arc::new(support::issuer().await);
    let resource = unique_resource("trait-floor");
    assert_eq!(issuer.raise_floor(&resource, 41).await.unwrap(), 41);
    assert_eq!(
        issuer.raise_floor(&resource, 7).await.unwrap(),
        41,
        "never lowered"
    );
    let lease = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
    assert_eq!(lease.token().get(), 42);
    issuer.release(&lease).await.unwrap();
    let stale = Error::StaleToken {
        target: pgfence::StaleTarget::Resource(resource.to_string()),
        presented: 42,
        current: 100,
        other_counter: false,
    };
    assert!(issuer.recover_from(&stale).await.unwrap());
    assert!(
        !issuer.recover_from(&stale).await.unwrap(),
        "already raised"
    );
    assert_eq!(issuer.status(&resource).await.unwrap().counter, 100);
    // reseed reads Postgres's high-water mark (none here): the counter stays.
    assert_eq!(issuer.reseed(&db.pool, &resource).await.unwrap(), 100);
}

#[tokio::test]
async fn key_prefixes_separate_locks_and_counters() {
    let url = redis_url().await;
    let default = Issuer::connect(&url).await.unwrap();
    let a = Issuer::connect(&url)
        .await
        .unwrap()
        .with_key_prefix("app-a")
        .unwrap();
    let b: Arc<dyn TokenIssuer> =
        connect_issuer_with(&url, IssuerOptions::new().key_prefix("app-b"))
            .await
            .unwrap();
    let resource = unique_resource("prefix");
    let in_domain = Resource::in_domain("billing", "account:1").unwrap();

    // Keys.
    assert_eq!(default.key_prefix(), "pgfence");
    assert_eq!(default.lock_key(&resource), pgfence::lock_key(&resource));
    assert_eq!(
        default.counter_key(&resource),
        pgfence::counter_key(&resource)
    );
    assert_eq!(a.lock_key(&resource), format!("app-a:{{{resource}}}:lock"));
    assert_eq!(
        a.counter_key(&resource),
        format!("app-a:{{{resource}}}:fence")
    );
    assert_eq!(a.lock_key(&in_domain), "app-a:{billing}:lock:account:1");
    assert_eq!(a.counter_key(&in_domain), "app-a:{billing}:fence");

    // The same resource under three prefixes: three locks, three counters.
    a.raise_floor(&resource, 10).await.unwrap();
    let la = a.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
    let lb = b.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
    let ld = default.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
    assert_eq!(la.token().get(), 11);
    assert_eq!(lb.token().get(), 1);
    assert_eq!(ld.token().get(), 1);
    assert!(a.acquire(&resource, 10 * SEC).await.unwrap().is_none());
    assert_eq!(a.status(&resource).await.unwrap().counter, 11);
    assert_eq!(b.status(&resource).await.unwrap().counter, 1);
    // A lease is released only through its own prefix.
    assert_eq!(
        default.release(&la).await.unwrap(),
        ReleaseOutcome::TakenByOther
    );
    assert_eq!(a.release(&la).await.unwrap(), ReleaseOutcome::Released);
    assert_eq!(
        default.status(&resource).await.unwrap().owner.as_deref(),
        Some(ld.owner())
    );
    let mut redis = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let held: Option<String> = redis
        .get(format!("app-b:{{{resource}}}:lock"))
        .await
        .unwrap();
    assert_eq!(held, Some(format!("{}:{}", lb.owner(), lb.token())));
    b.release(&lb).await.unwrap();
    default.release(&ld).await.unwrap();
    let _: () = redis
        .del(&[
            a.counter_key(&resource),
            format!("app-b:{{{resource}}}:fence"),
            default.counter_key(&resource),
        ])
        .await
        .unwrap();
}

#[tokio::test]
async fn bad_prefixes_and_urls_are_refused() {
    let issuer = support::issuer().await;
    let long = "x".repeat(pgfence::MAX_KEY_PREFIX_LEN + 1);
    for bad in ["", "a b", "a{b", "b}", "tab\there", "nl\n", long.as_str()] {
        let err = issuer.clone().with_key_prefix(bad).unwrap_err();
        assert!(matches!(err, Error::InvalidKeyPrefix(_)), "{bad:?}: {err}");
    }
    let max = "y".repeat(pgfence::MAX_KEY_PREFIX_LEN);
    for good in ["myapp", "my-app:prod", "a", max.as_str()] {
        assert_eq!(
            issuer.clone().with_key_prefix(good).unwrap().key_prefix(),
            good
        );
    }
    assert!(matches!(
        connect_issuer("memcached://127.0.0.1").await,
        Err(Error::InvalidIssuerUrl(_))
    ));
    assert!(matches!(
        connect_issuer_with(&redis_url().await, IssuerOptions::new().key_prefix("{x}")).await,
        Err(Error::InvalidKeyPrefix(_))
    ));
    #[cfg(not(feature = "etcd"))]
    {
        let err = connect_issuer("etcd://127.0.0.1:2379").await.unwrap_err();
        assert!(
            matches!(
                err,
                Error::IssuerNotBuilt {
                    feature: "etcd",
                    ..
                }
            ),
            "{err}"
        );
    }
}

/// `Issuer::keep_alive` still works, and `KeepAlive::spawn` takes a concrete issuer too.
#[tokio::test]
async fn keep_alive_with_a_concrete_issuer() {
    let issuer = support::issuer().await;
    let resource = unique_resource("trait-keep");
    let ttl = Duration::from_millis(300);
    let lease = issuer.acquire(&resource, ttl).await.unwrap().unwrap();
    let keep = issuer.keep_alive(&lease);
    let also = KeepAlive::spawn(Arc::new(issuer.clone()), lease.clone());
    let started = Instant::now();
    tokio::time::sleep(ttl * 2).await;
    assert!(keep.deadline().is_some_and(|d| d > started + ttl));
    keep.stop();
    also.stop();
    assert_eq!(
        issuer.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
}

#[cfg(feature = "etcd")]
mod etcd {
    use super::*;
    use pgfence::EtcdIssuer;
    use pgfence_testkit::{EtcdCluster, etcd_installed};
    use tokio::sync::OnceCell;

    static SINGLE: OnceCell<(String, Option<EtcdCluster>)> = OnceCell::const_new();

    fn skip(test: &str) -> bool {
        if std::env::var("PGFENCE_ETCD_URL").is_ok_and(|u| !u.is_empty()) || etcd_installed() {
            return false;
        }
        eprintln!("SKIPPED {test}: etcd is not installed (Debian: apt-get install etcd-server)");
        true
    }

    async fn etcd_url() -> String {
        SINGLE
            .get_or_init(|| async {
                match std::env::var("PGFENCE_ETCD_URL") {
                    Ok(url) if !url.is_empty() => (url, None),
                    _ => {
                        let node = EtcdCluster::single().await.expect("start throwaway etcd");
                        (node.url(), Some(node))
                    }
                }
            })
            .await
            .0
            .clone()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_through_the_trait() {
        if skip("etcd_through_the_trait") {
            return;
        }
        let issuer = connect_issuer(&etcd_url().await).await.unwrap();
        assert_eq!(issuer.kind(), IssuerKind::Etcd);
        assert!(!issuer.kind().can_reseed());
        // etcd leases count whole seconds, with a server minimum of 2 s by default.
        lease_semantics(issuer, SEC, 4 * SEC).await;
    }

    /// Revisions never go backwards: raise_floor and recover_from do nothing.
    #[tokio::test]
    async fn etcd_floor_and_recovery_are_no_ops() {
        if skip("etcd_floor_and_recovery_are_no_ops") {
            return;
        }
        let issuer = connect_issuer(&etcd_url().await).await.unwrap();
        let resource = unique_resource("trait-etcd-floor");
        let revision = issuer.status(&resource).await.unwrap().counter;
        let after = issuer.raise_floor(&resource, i64::MAX / 2).await.unwrap();
        assert!(after >= revision && after < i64::MAX / 2, "{after}");
        assert!(matches!(
            issuer.raise_floor(&resource, -1).await,
            Err(Error::InvalidToken(_))
        ));
        let stale = Error::StaleToken {
            target: pgfence::StaleTarget::Resource(resource.to_string()),
            presented: 1,
            current: i64::MAX / 2,
            other_counter: false,
        };
        assert!(!issuer.recover_from(&stale).await.unwrap());
        let lease = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
        assert!(lease.token().get() > revision);
        assert_eq!(
            issuer.release(&lease).await.unwrap(),
            ReleaseOutcome::Released
        );
    }

    /// Two prefixes on one etcd: two locks for one resource.
    #[tokio::test]
    async fn etcd_key_prefixes_separate_locks() {
        if skip("etcd_key_prefixes_separate_locks") {
            return;
        }
        let url = etcd_url().await;
        let a = EtcdIssuer::connect(&url)
            .await
            .unwrap()
            .with_key_prefix("app-a")
            .unwrap();
        let b = connect_issuer_with(&url, IssuerOptions::new().key_prefix("app-b"))
            .await
            .unwrap();
        let resource = unique_resource("trait-etcd-prefix");
        assert_eq!(a.lock_key(&resource), format!("app-a/lock/{resource}"));
        let la = a.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
        let lb = b.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
        assert!(a.acquire(&resource, 10 * SEC).await.unwrap().is_none());
        // Under b's prefix the resource's lock is lb's: la's handle cannot touch it.
        assert_eq!(
            b.release(&la).await.unwrap(),
            ReleaseOutcome::TakenByOther,
            "not its lock"
        );
        assert_eq!(a.release(&la).await.unwrap(), ReleaseOutcome::Released);
        assert_eq!(b.release(&lb).await.unwrap(), ReleaseOutcome::Released);
    }
}

#[cfg(feature = "zk")]
mod zk {
    use super::*;
    use pgfence::ZkIssuer;
    use pgfence_testkit::{ZkEnsemble, zk_installed};
    use tokio::sync::OnceCell;

    static SINGLE: OnceCell<(String, Option<ZkEnsemble>)> = OnceCell::const_new();

    fn skip(test: &str) -> bool {
        if std::env::var("PGFENCE_ZK_URL").is_ok_and(|u| !u.is_empty()) || zk_installed() {
            return false;
        }
        eprintln!("SKIPPED {test}: ZooKeeper is not installed (Debian: apt-get install zookeeper)");
        true
    }

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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn zk_through_the_trait() {
        if skip("zk_through_the_trait") {
            return;
        }
        let issuer = connect_issuer(&zk_url().await).await.unwrap();
        assert_eq!(issuer.kind(), IssuerKind::ZooKeeper);
        assert_eq!(issuer.kind().name(), "zk");
        assert!(!issuer.kind().can_reseed());
        // The issuer's own timer ends a lapsed lease: sub-second TTLs work.
        lease_semantics(issuer, Duration::from_millis(300), SEC).await;
    }

    /// zxids never go backwards: raise_floor and recover_from do nothing.
    #[tokio::test]
    async fn zk_floor_and_recovery_are_no_ops() {
        if skip("zk_floor_and_recovery_are_no_ops") {
            return;
        }
        let issuer = connect_issuer(&zk_url().await).await.unwrap();
        let resource = unique_resource("trait-zk-floor");
        let first = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
        issuer.release(&first).await.unwrap();
        let counter = issuer.status(&resource).await.unwrap().counter;
        assert!(counter > first.token().get(), "the release's zxid");
        let after = issuer.raise_floor(&resource, i64::MAX / 2).await.unwrap();
        assert_eq!(after, counter, "nothing raised");
        assert!(matches!(
            issuer.raise_floor(&resource, -1).await,
            Err(Error::InvalidToken(_))
        ));
        let stale = Error::StaleToken {
            target: pgfence::StaleTarget::Resource(resource.to_string()),
            presented: 1,
            current: i64::MAX / 2,
            other_counter: false,
        };
        assert!(!issuer.recover_from(&stale).await.unwrap());
        let lease = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
        assert!(lease.token().get() > counter);
        assert_eq!(
            issuer.release(&lease).await.unwrap(),
            ReleaseOutcome::Released
        );
    }

    /// Two prefixes on one ensemble: two locks for one resource.
    #[tokio::test]
    async fn zk_key_prefixes_separate_locks() {
        if skip("zk_key_prefixes_separate_locks") {
            return;
        }
        let url = zk_url().await;
        let a = ZkIssuer::connect(&url)
            .await
            .unwrap()
            .with_key_prefix("app-a")
            .unwrap();
        let b = connect_issuer_with(&url, IssuerOptions::new().key_prefix("app-b"))
            .await
            .unwrap();
        let resource = unique_resource("trait-zk-prefix");
        assert_eq!(a.lock_dir(&resource), format!("/app-a/lock/{resource}"));
        let la = a.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
        let lb = b.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
        assert!(a.acquire(&resource, 10 * SEC).await.unwrap().is_none());
        assert_eq!(
            b.release(&la).await.unwrap(),
            ReleaseOutcome::TakenByOther,
            "not its lock"
        );
        assert_eq!(a.release(&la).await.unwrap(), ReleaseOutcome::Released);
        assert_eq!(b.release(&lb).await.unwrap(), ReleaseOutcome::Released);
    }
}
