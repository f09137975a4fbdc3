//! The Redis token issuer against real Redis (and a real 3-master cluster): the lease
//! semantics every issuer shares (`issuer_suite`), and what is Redis's own: the key layout,
//! counter loss and reseeding, the floor source, keep-alive, Cluster, the connections.

use crate::issuer_suite;
use crate::support;

use std::time::Duration;

use pgfence::issuer::redis::{counter_key, lock_key};
use pgfence::{
    Error, Fence, RedisIssuer, Resource,
    issuer::{LeaseLost, LeaseState, ReleaseOutcome},
};
use pgfence_testkit::{RedisCluster, Server};
use redis::AsyncCommands;
use support::{TestDb, issuer, redis_url, unique_resource};

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
fn skip(_test: &str) -> Option<()> {
    Some(())
}

/// The suite's issuer: [`issuer`] (nothing optional to start).
async fn suite_issuer((): ()) -> RedisIssuer {
    issuer().await
}

async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

// The suite's shared tests, as for the other issuers:
// concurrent_acquisitions_are_exclusive_and_strictly_increasing,
// expired_lease_cannot_release_or_extend_the_next_holders_lock,
// owner_extend_keeps_the_lock_past_its_ttl,
// retried_acquire_by_the_same_owner_returns_the_same_token,
// wait_acquire_gets_the_lock_when_it_frees_and_gives_up_on_time,
// paused_holder_is_fenced_by_postgres.
issuer_suite::lease_tests!(REDIS, skip, suite_issuer);

/// The suite's shared tests again through Redis Sentinel (a master, a replica and a sentinel,
/// shared by this binary's tests): the same backend behind the connections that follow the
/// master.
mod through_sentinel {
    use pgfence::{RedisIssuer, issuer::redis::SentinelConnections};
    use pgfence_testkit::optional::Sentinel;
    use pgfence_testkit::{SentinelConfig, SentinelSet};
    use tokio::sync::OnceCell;

    use super::REDIS;
    use crate::issuer_suite::{self, Shared};

    const ENV: &str = "PGFENCE_SENTINEL_URL";

    fn needs_sentinel(test: &str) -> Option<Shared<Sentinel>> {
        issuer_suite::external_or_needs(ENV, test)
    }

    async fn issuer(sentinel: Shared<Sentinel>) -> RedisIssuer<SentinelConnections> {
        static SET: OnceCell<(String, Option<SentinelSet>)> = OnceCell::const_new();
        let url = issuer_suite::shared_url(&SET, ENV, async {
            let sentinel = issuer_suite::proof(sentinel, ENV);
            let set = SentinelSet::start(sentinel, "pgfence-suite", SentinelConfig::default())
                .await
                .expect("start a throwaway Sentinel deployment");
            (set.url(), set)
        })
        .await;
        RedisIssuer::connect_sentinel(&url)
            .await
            .expect("connect through the sentinels")
    }

    issuer_suite::lease_tests!(REDIS, needs_sentinel, issuer);
}

#[tokio::test]
async fn bad_ttls_and_names_are_refused_before_touching_redis() {
    issuer_suite::bad_ttls_and_owners_are_refused(&REDIS, issuer().await).await;
    // Not even the counter: an acquire refused before sending leaves no key.
    let issuer = issuer().await;
    let resource = unique_resource("bad-ttl");
    assert!(matches!(
        issuer.acquire(&resource, Duration::ZERO).await,
        Err(Error::Invalid(pgfence::error::InvalidInput::Duration(_)))
    ));
    let mut conn = raw(&redis_url().await).await;
    let exists: i64 = conn
        .exists(&[lock_key(&resource), counter_key(&resource)])
        .await
        .unwrap();
    assert_eq!(exists, 0, "nothing written");
    for bad in [
        "",
        "has space",
        "a{b",
        "b}c",
        "new\nline",
        "nul\0",
        &"x".repeat(201),
    ] {
        assert!(
            matches!(
                Resource::new(bad),
                Err(Error::Invalid(pgfence::error::InvalidInput::Resource(_)))
            ),
            "{bad:?}"
        );
    }
}

/// The keys are what the docs say (a domain's resources share its counter and hash tag), and a
/// lock deleted by hand is lost to its holder.
#[tokio::test]
async fn layout_domains_and_a_deleted_lock() {
    let issuer = issuer().await;
    let domain = format!("dom{}", rand::random::<u32>());
    let one = Resource::in_domain(&domain, "account:1").unwrap();
    let two = Resource::in_domain(&domain, "account:2").unwrap();
    let a = issuer.acquire(&one, 5 * SEC).await.unwrap().unwrap();
    let b = issuer.acquire(&two, 5 * SEC).await.unwrap().unwrap();
    assert_eq!(
        b.token().get(),
        a.token().get() + 1,
        "one counter per domain"
    );
    assert_eq!(
        lock_key(&two),
        format!("pgfence:{{{domain}}}:lock:account:2")
    );
    assert_eq!(counter_key(&two), format!("pgfence:{{{domain}}}:fence"));
    let mut conn = raw(&redis_url().await).await;
    let held: Option<String> = conn.get(lock_key(&two)).await.unwrap();
    assert_eq!(held, Some(format!("{}:{}", b.owner(), b.token())));
    let counter: i64 = conn.get(counter_key(&one)).await.unwrap();
    assert_eq!(counter, b.token().get());
    assert_eq!(issuer.status(&one).await.unwrap().counter, counter);

    // An operator deletes A's lock and someone takes it: A is told so, and cannot free it.
    let _: () = conn.del(lock_key(&one)).await.unwrap();
    issuer_suite::deleted_lock_is_lost_to_its_holder(&issuer, &one, a, &b).await;
    let _: () = conn.del(counter_key(&one)).await.unwrap();
}

/// `acquire_as` records which call of its owner took the lock (the attempt key, which a failed
/// call's clean-up reads); `acquire`, whose owner id is the call's own, writes no such key.
#[tokio::test]
async fn only_a_callers_owner_id_gets_an_attempt_record() {
    let issuer = issuer().await;
    let mut conn = raw(&redis_url().await).await;
    let own = Resource::new(format!("attempt-own-{}", rand::random::<u32>())).unwrap();
    let callers = Resource::new(format!("attempt-callers-{}", rand::random::<u32>())).unwrap();
    let attempt = |r: &Resource| format!("pgfence:{{{r}}}:attempt");
    let a = issuer.acquire(&own, 5 * SEC).await.unwrap().unwrap();
    let b = issuer
        .acquire_as(&callers, "worker-1", 5 * SEC)
        .await
        .unwrap()
        .unwrap();
    let own_record: Option<String> = conn.get(attempt(&own)).await.unwrap();
    let callers_record: Option<String> = conn.get(attempt(&callers)).await.unwrap();
    assert_eq!(own_record, None);
    assert!(
        callers_record.is_some_and(|id| id.len() == 16),
        "acquire_as wrote no call id"
    );
    issuer.release(&a).await.unwrap();
    issuer.release(&b).await.unwrap();
}

/// Keys under a prefix; the suite's two prefixes on one Redis (two locks for one resource); and
/// three counters for it, the default prefix's included.
#[tokio::test]
async fn key_prefixes_separate_locks_and_counters() {
    let url = redis_url().await;
    let default = RedisIssuer::connect(&url).await.unwrap();
    let a = RedisIssuer::connect(&url)
        .await
        .unwrap()
        .with_key_prefix("app-a")
        .unwrap();
    let resource = unique_resource("prefix");
    let in_domain = Resource::in_domain("billing", "account:1").unwrap();

    // Keys.
    assert_eq!(default.key_prefix(), "pgfence");
    assert_eq!(default.lock_key(&resource), lock_key(&resource));
    assert_eq!(default.counter_key(&resource), counter_key(&resource));
    assert_eq!(a.lock_key(&resource), format!("app-a:{{{resource}}}:lock"));
    assert_eq!(
        a.counter_key(&resource),
        format!("app-a:{{{resource}}}:fence")
    );
    assert_eq!(a.lock_key(&in_domain), "app-a:{billing}:lock:account:1");
    assert_eq!(a.counter_key(&in_domain), "app-a:{billing}:fence");

    issuer_suite::key_prefixes_separate_locks(&a, &url, &resource).await;

    // The same resource under three prefixes: three counters.
    assert_eq!(a.raise_floor(&resource, 10).await.unwrap(), 10);
    let la = a.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
    let ld = default.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
    assert_eq!(la.token().get(), 11);
    assert_eq!(ld.token().get(), 1);
    assert_eq!(a.status(&resource).await.unwrap().counter, 11);
    let mut redis = raw(&url).await;
    let b_counter: i64 = redis
        .get(format!("app-b:{{{resource}}}:fence"))
        .await
        .unwrap();
    assert_eq!(b_counter, 1);
    // A lease is released only through its own prefix.
    assert_eq!(
        default.release(&la).await.unwrap(),
        ReleaseOutcome::TakenByOther
    );
    assert_eq!(a.release(&la).await.unwrap(), ReleaseOutcome::Released);
    assert_eq!(
        default.release(&ld).await.unwrap(),
        ReleaseOutcome::Released
    );
    let _: () = redis
        .del(&[
            a.counter_key(&resource),
            format!("app-b:{{{resource}}}:fence"),
            default.counter_key(&resource),
        ])
        .await
        .unwrap();
}

/// A failover that loses the counter: safety from Postgres, liveness from reseeding.
#[tokio::test]
async fn counter_loss_is_safe_and_reseed_restores_liveness() {
    let db = TestDb::new().await;
    let fence = Fence::new(db.pool.clone());
    let issuer = issuer().await;
    let resource = unique_resource("failover");
    for _ in 0..5 {
        let lease = issuer.acquire(&resource, 5 * SEC).await.unwrap().unwrap();
        fence.check(&db.pool, &resource, &lease).await.unwrap();
        issuer.release(&lease).await.unwrap();
    }
    assert_eq!(fence.high_water(&resource).await.unwrap(), 5);

    // The failover: the counter is gone.
    let _: () = raw(&redis_url().await)
        .await
        .del(counter_key(&resource))
        .await
        .unwrap();
    let lease = issuer.acquire(&resource, 5 * SEC).await.unwrap().unwrap();
    assert_eq!(lease.token().get(), 1);
    let err = fence.check(&db.pool, &resource, &lease).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::StaleToken {
                presented: 1,
                current: 5,
                ..
            }
        ),
        "safety: {err:?}"
    );
    issuer.release(&lease).await.unwrap();

    // One call restores liveness.
    assert_eq!(issuer.reseed(&db.pool, &resource).await.unwrap(), 5);
    let lease = issuer.acquire(&resource, 5 * SEC).await.unwrap().unwrap();
    assert_eq!(lease.token().get(), 6);
    fence.check(&db.pool, &resource, &lease).await.unwrap();
    issuer.release(&lease).await.unwrap();

    // raise_floor only raises.
    assert_eq!(issuer.raise_floor(&resource, 2).await.unwrap(), 6);
    assert!(issuer.raise_floor(&resource, -1).await.is_err());
}

/// With a floor source the issuer recovers from a restarted, empty Redis by itself, and a row
/// write rejected after partial loss recovers with one call.
#[tokio::test]
async fn restarted_redis_recovers_automatically_with_a_floor_source() {
    let db = TestDb::new().await;
    let fence = Fence::new(db.pool.clone());
    let mut server = Server::redis().await.unwrap();
    let issuer = RedisIssuer::connect(&server.url())
        .await
        .unwrap()
        .with_floor_source(db.pool.clone());
    let resource = unique_resource("restart");
    for _ in 0..3 {
        let lease = issuer.acquire(&resource, 5 * SEC).await.unwrap().unwrap();
        fence.check(&db.pool, &resource, &lease).await.unwrap();
        issuer.release(&lease).await.unwrap();
    }

    server.restart().await.unwrap(); // no persistence: every key is gone
    let lease = loop {
        // The connection manager reconnects; early attempts may see the dropped connection.
        match issuer.acquire(&resource, 5 * SEC).await {
            Ok(l) => break l.unwrap(),
            Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(
        lease.token().get(),
        4,
        "reseeded past the high-water mark 3"
    );
    fence.check(&db.pool, &resource, &lease).await.unwrap();
    issuer.release(&lease).await.unwrap();

    // Partial loss on a row-only path: a rejected write tells recover_from what to raise to.
    let other = unique_resource("rows");
    let err = Error::StaleToken {
        target: pgfence::error::StaleTarget::Row {
            table: "\"public\".\"t\"".into(),
            key: "[1]".into(),
            resource: Some(other.to_string()),
            held_by: None,
        },
        presented: 1,
        current: 40,
        other_counter: false,
    };
    assert!(issuer.recover_from(&err).await.unwrap());
    assert_eq!(
        issuer
            .acquire(&other, SEC)
            .await
            .unwrap()
            .unwrap()
            .token()
            .get(),
        41
    );
}

#[tokio::test]
async fn keep_alive_outlives_several_ttls_and_reports_loss() {
    let server = Server::redis().await.unwrap();
    let issuer = RedisIssuer::connect(&server.url()).await.unwrap();
    let resource = unique_resource("keepalive");
    let lease = issuer
        .acquire(&resource, Duration::from_millis(600))
        .await
        .unwrap()
        .unwrap();
    let mut keep = issuer.keep_alive(&lease);
    tokio::time::sleep(Duration::from_millis(2400)).await; // four TTLs
    let status = issuer.status(&resource).await.unwrap();
    assert_eq!(status.owner.as_deref(), Some(lease.owner()), "still held");
    assert!(keep.deadline().unwrap() > lease.deadline());

    drop(server); // Redis goes away
    let lost = tokio::time::timeout(5 * SEC, keep.lost())
        .await
        .expect("loss signalled");
    assert!(matches!(lost, LeaseLost::Unreachable(_)), "{lost:?}");
    assert!(keep.deadline().is_none());
}

#[tokio::test]
async fn keep_alive_reports_a_taken_lock() {
    let issuer = issuer().await;
    let resource = unique_resource("taken");
    let lease = issuer
        .acquire(&resource, Duration::from_millis(300))
        .await
        .unwrap()
        .unwrap();
    let mut keep = issuer.keep_alive(&lease);
    // Someone deletes the lock and takes it (as an operator or a buggy client might).
    let _: () = raw(&redis_url().await)
        .await
        .del(lock_key(&resource))
        .await
        .unwrap();
    let _thief = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
    assert_eq!(
        tokio::time::timeout(5 * SEC, keep.lost()).await.unwrap(),
        LeaseLost::Taken
    );
}

#[tokio::test]
async fn works_on_a_three_master_cluster() {
    let cluster = RedisCluster::start(3).await.unwrap();
    let db = TestDb::new().await;
    let issuer = RedisIssuer::connect_cluster(&cluster.urls()).await.unwrap();
    let mut slots = std::collections::HashSet::new();
    for i in 0..20 {
        let resource = Resource::new(format!("cluster:{i}")).unwrap();
        let mut lease = issuer.acquire(&resource, 5 * SEC).await.unwrap().unwrap();
        assert_eq!(lease.token().get(), 1);
        assert_eq!(
            issuer.extend(&mut lease, 10 * SEC).await.unwrap(),
            LeaseState::Held
        );
        assert_eq!(issuer.status(&resource).await.unwrap().token, Some(1));
        assert_eq!(
            issuer.release(&lease).await.unwrap(),
            ReleaseOutcome::Released
        );
        sqlx::query("SELECT pgfence.check($1, 9)")
            .bind(resource.as_str())
            .execute(&db.pool)
            .await
            .unwrap();
        assert_eq!(issuer.reseed(&db.pool, &resource).await.unwrap(), 9);
        assert_eq!(
            issuer
                .acquire(&resource, SEC)
                .await
                .unwrap()
                .unwrap()
                .token()
                .get(),
            10
        );

        let mut node = raw(&cluster.urls()[0]).await;
        let lock_slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(lock_key(&resource))
            .query_async(&mut node)
            .await
            .unwrap();
        let counter_slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(counter_key(&resource))
            .query_async(&mut node)
            .await
            .unwrap();
        assert_eq!(lock_slot, counter_slot);
        slots.insert(lock_slot);
    }
    assert!(slots.len() > 10, "resources spread over the cluster");
}

/// `RedisIssuer::connect_with` opens the connections it is asked for and spreads commands over them:
/// Redis (its own server, so no other test's clients are listed) sees three client
/// connections whose last command was the issuer's script.
#[tokio::test]
async fn commands_are_spread_over_the_issuers_connections() {
    let server = Server::redis().await.expect("throwaway Redis");
    let url = server.url();
    let issuer = RedisIssuer::connect_with(&url, std::num::NonZeroUsize::new(3).unwrap())
        .await
        .unwrap();
    let res = unique_resource("spread");
    let mut last = 0;
    for _ in 0..6 {
        let lease = issuer
            .acquire(&res, Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap();
        assert!(
            lease.token().get() > last,
            "tokens keep rising across connections"
        );
        last = lease.token().get();
        assert_eq!(
            issuer.release(&lease).await.unwrap(),
            ReleaseOutcome::Released
        );
    }

    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut raw(&url).await)
        .await
        .unwrap();
    let scripted: Vec<&str> = list.lines().filter(|l| l.contains("cmd=evalsha")).collect();
    assert_eq!(
        scripted.len(),
        3,
        "three connections whose last command was the issuer's script:\n{list}"
    );
}
