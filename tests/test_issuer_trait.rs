//! The lease semantics every issuer shares, checked through `Arc<dyn TokenIssuer>` (as a CLI
//! or a service that picks its issuer from a URL holds it) on Redis: `lease_semantics` of the
//! shared suite in `issuer_suite`, which `etcd_through_the_trait` (`tests/test_etcd_issuer.rs`)
//! and `zk_through_the_trait` (`tests/test_zk_issuer.rs`) run on the other issuers. Also
//! Redis's floor and recovery, and the key prefixes.

// The leader failover and its `Cluster` are the consensus stores' (etcd, ZooKeeper) tests.
#[allow(
    dead_code,
    reason = "the cluster failover is the consensus stores' test"
)]
mod issuer_suite;
mod support;

use std::sync::Arc;
use std::time::Duration;

use pgfence::{
    Error, Issuer, IssuerKind, IssuerOptions, KeepAlive, ReleaseOutcome, Resource, TokenIssuer,
    connect_issuer, connect_issuer_with,
};
use redis::AsyncCommands;
use support::{TestDb, issuer, redis_url, unique_resource};
use tokio::time::Instant;

const SEC: Duration = Duration::from_secs(1);

/// Redis keeps TTLs to the millisecond and tells a refused owner the holder's remaining TTL;
/// the counter is the resource's last token.
const REDIS: issuer_suite::Profile = issuer_suite::Profile {
    name: "redis",
    label: "Redis",
    ttl_resolution: Duration::ZERO,
    expiry_slack: Duration::from_secs(2),
    reports_retry_in: true,
    counter_is_last_token: true,
};

/// Nothing to skip: Redis is what every issuer test of this crate needs.
fn skip(_test: &str) -> bool {
    false
}

// The suite's shared tests, as for the other issuers (they were copies in test_issuer.rs):
// concurrent_acquisitions_are_exclusive_and_strictly_increasing,
// expired_lease_cannot_release_or_extend_the_next_holders_lock,
// owner_extend_keeps_the_lock_past_its_ttl,
// retried_acquire_by_the_same_owner_returns_the_same_token,
// wait_acquire_gets_the_lock_when_it_frees_and_gives_up_on_time,
// paused_holder_is_fenced_by_postgres.
issuer_suite::lease_tests!(REDIS, skip, issuer);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_through_the_trait() {
    let issuer = connect_issuer(&redis_url().await).await.unwrap();
    assert_eq!(issuer.kind(), IssuerKind::Redis);
    assert!(issuer.kind().can_reseed());
    issuer_suite::lease_semantics(
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
