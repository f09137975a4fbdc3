//! The Redis token issuer against real Redis (and a real 3-master cluster).

mod support;

use std::time::Duration;

use pgfence::{
    Error, Fence, Issuer, LeaseLost, LeaseState, ReleaseOutcome, Repository, Resource, TableName,
};
use pgfence::{counter_key, lock_key};
use pgfence_testkit::{RedisCluster, Server};
use redis::AsyncCommands;
use support::{Logs, TestDb, issuer, redis_url, unique_resource};

const SEC: Duration = Duration::from_secs(1);

async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

// The lease semantics every issuer shares (exclusive, increasing acquisitions, expiry,
// extend, the idempotent retry, waiting, a paused holder fenced by Postgres) run on Redis from
// the shared suite, in `tests/test_issuer_trait.rs`.

#[tokio::test]
async fn bad_ttls_and_names_are_refused_before_touching_redis() {
    let issuer = issuer().await;
    let resource = unique_resource("bad-ttl");
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
            matches!(Resource::new(bad), Err(Error::InvalidResource(_))),
            "{bad:?}"
        );
    }
    assert!(issuer.acquire_as(&resource, "own:er", SEC).await.is_err());
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
    let issuer = Issuer::connect(&server.url())
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
        target: pgfence::StaleTarget::Row {
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
    let issuer = Issuer::connect(&server.url()).await.unwrap();
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
    let issuer = Issuer::connect_cluster(&cluster.urls()).await.unwrap();
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

/// The seed's race end to end, with real lease expiry.
#[tokio::test]
async fn seed_race_with_real_leases() {
    let (logs, _guard) = Logs::capture();
    let db = TestDb::new().await;
    db.exec("CREATE TABLE inventory_snapshot (sku text PRIMARY KEY, payload text NOT NULL); INSERT INTO inventory_snapshot VALUES ('A-1', 'initial');").await;
    pgfence::guard(&db.pool, &TableName::parse("inventory_snapshot").unwrap())
        .await
        .unwrap();
    #[derive(Clone)]
    struct Snapshot {
        sku: String,
        payload: String,
    }
    pgfence::fenced_table!(Snapshot { table: "inventory_snapshot", key: sku: String, columns: [payload] });
    let repo = Repository::<Snapshot>::new(db.pool.clone()).unwrap();
    let issuer = issuer().await;
    let resource = unique_resource("inventory");

    let a = issuer
        .acquire(&resource, Duration::from_millis(100))
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await; // A pauses past its TTL
    let b = issuer
        .acquire(&resource, 5 * SEC)
        .await
        .unwrap()
        .expect("lock expired");
    repo.update(
        &db.pool,
        &b,
        &Snapshot {
            sku: "A-1".into(),
            payload: "B".into(),
        },
    )
    .await
    .unwrap();
    let err = repo
        .update(
            &db.pool,
            &a,
            &Snapshot {
                sku: "A-1".into(),
                payload: "A".into(),
            },
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::StaleToken { presented, current, .. } if presented == a.token().get() && current == b.token().get())
    );
    let payload: String = sqlx::query_scalar("SELECT payload FROM inventory_snapshot")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(payload, "B");
    let audit = pgfence::list_audit(&db.pool, &Default::default())
        .await
        .unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0].holder.as_deref(), Some(a.owner()));
    assert_eq!(audit[0].resource.as_deref(), Some(resource.as_str()));
    assert_eq!(logs.with(pgfence::LOG_TARGET, "WARN").len(), 1);
}

/// `Issuer::connect_with` opens the connections it is asked for and spreads commands over them:
/// Redis (its own server, so no other test's clients are listed) sees three client
/// connections whose last command was the issuer's script.
#[tokio::test]
async fn commands_are_spread_over_the_issuers_connections() {
    let server = Server::redis().await.expect("throwaway Redis");
    let url = server.url();
    let issuer = Issuer::connect_with(&url, std::num::NonZeroUsize::new(3).unwrap())
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
