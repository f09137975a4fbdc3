//! A refused acquire changes nothing, on every issuer (issue 20, point 6): an acquire whose
//! token would pass the token limit ([`MAX_TOKEN`] = 2^39 − 1) is refused before anything is
//! written, so afterwards the lock is free, the counter as it was and no lock key or node
//! exists; the next owner gets the same refusal (not "lock held"), and once the counter is
//! repaired the lock can be taken at once.
//!
//! * Redis (standalone, Sentinel, Cluster): the counter is set at and past the limit by hand,
//!   and a lost counter is refused when PostgreSQL's high-water mark is at the limit.
//! * PostgreSQL issuer: its counter row is set to the limit by hand.
//! * ZooKeeper: a throwaway standalone server is restarted with its zxid at the limit (its
//!   snapshot renamed: a standalone server takes its last zxid from the snapshot's name).
//! * etcd: its revision cannot be raised to 2^39 in a test (the installed etcd 3.4 has no
//!   `--bump-revision`); what is reachable is tested: an acquire refused because the lock is
//!   held writes nothing (the revision stays).

use crate::support;

use std::time::Duration;

use pgfence::{Error, RedisIssuer, Resource, issuer::PgIssuer, token::MAX_TOKEN};
use pgfence_testkit::{RedisCluster, SentinelConfig, SentinelSet, needs, optional};
use redis::AsyncCommands;
use redis::aio::ConnectionLike;
use support::{TestDb, redis_url, unique_resource};

const SEC: Duration = Duration::from_secs(1);

/// `err` is the refusal at the token limit: the variant the issuers return for it, saying the
/// limit was reached, that the acquire changed nothing (or undid what it wrote: `undone`),
/// and what to run.
#[track_caller]
fn assert_refused(err: &Error, resource: &Resource, undone: bool) {
    assert!(
        matches!(err, Error::Invalid(pgfence::error::InvalidInput::Token(_))),
        "{err:?}"
    );
    let text = err.to_string();
    let outcome = if undone {
        "left nothing behind"
    } else {
        "changed nothing"
    };
    for needle in [
        "reached the token limit",
        "the acquire was refused",
        outcome,
        "pgfence doctor",
        resource.as_str(),
    ] {
        assert!(text.contains(needle), "{needle:?} missing from: {text}");
    }
}

/// The refusal before anything was written.
#[track_caller]
fn assert_limit(err: &Error, resource: &Resource) {
    assert_refused(err, resource, false);
}

async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// The Redis checks, on any deployment: `raw` is a plain connection to the same data.
async fn redis_refuses_at_the_limit<C, R>(issuer: &RedisIssuer<C>, raw: &mut R, label: &str)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
    R: ConnectionLike + Send + Sync,
{
    for start in [
        MAX_TOKEN.to_string(),
        (MAX_TOKEN + 1).to_string(),
        i64::MAX.to_string(),
        "99999999999999999999999".to_owned(),
    ] {
        let resource = unique_resource(&format!("{label}-limit"));
        let (lock, counter) = (issuer.lock_key(&resource), issuer.counter_key(&resource));
        let () = raw.set(&counter, &start).await.unwrap();

        let err = issuer.acquire(&resource, 30 * SEC).await.unwrap_err();
        assert_limit(&err, &resource);
        let exists: i64 = raw.exists(&lock).await.unwrap();
        assert_eq!(
            exists, 0,
            "{label} {start}: the refused acquire left a lock"
        );
        let now: String = raw.get(&counter).await.unwrap();
        assert_eq!(now, start, "{label}: the refused acquire moved the counter");

        // Another owner is refused the same way, not told the lock is held; so is a waiter,
        // at once.
        let err = issuer
            .acquire_as(&resource, "second-owner", 30 * SEC)
            .await
            .unwrap_err();
        assert_limit(&err, &resource);
        let err = tokio::time::timeout(5 * SEC, issuer.acquire_wait(&resource, 30 * SEC, 10 * SEC))
            .await
            .expect("a waiter gets the refusal at once")
            .unwrap_err();
        assert_limit(&err, &resource);
        let exists: i64 = raw.exists(&lock).await.unwrap();
        assert_eq!(exists, 0, "{label} {start}: a refused acquire left a lock");
        let now: String = raw.get(&counter).await.unwrap();
        assert_eq!(now, start, "{label}: a refused acquire moved the counter");
        // (status reads the counter as an i64: not every value here is one.)
        if let Ok(status) = issuer.status(&resource).await {
            assert_eq!(status.owner, None, "{label}: the lock is free");
        }

        // Repaired by hand: the lock is free, the next token follows the repaired counter.
        let () = raw.set(&counter, "41").await.unwrap();
        let lease = issuer.acquire(&resource, 30 * SEC).await.unwrap().unwrap();
        assert_eq!(lease.token().get(), 42, "{label}");
        issuer.release(&lease).await.unwrap();
    }

    // One below the limit still issues the last token; then the counter is at the limit.
    let resource = unique_resource(&format!("{label}-last"));
    let counter = issuer.counter_key(&resource);
    let () = raw.set(&counter, MAX_TOKEN - 1).await.unwrap();
    let lease = issuer.acquire(&resource, 30 * SEC).await.unwrap().unwrap();
    assert_eq!(lease.token().get(), MAX_TOKEN);
    issuer.release(&lease).await.unwrap();
    let err = issuer.acquire(&resource, 30 * SEC).await.unwrap_err();
    assert_limit(&err, &resource);
    let exists: i64 = raw.exists(issuer.lock_key(&resource)).await.unwrap();
    assert_eq!(exists, 0);

    // A fencing domain's counter at the limit refuses every resource of the domain.
    let domain = format!("{label}-dom{}", rand::random::<u32>());
    let a = Resource::in_domain(&domain, "a").unwrap();
    let b = Resource::in_domain(&domain, "b").unwrap();
    let counter = issuer.counter_key(&a);
    let () = raw.set(&counter, MAX_TOKEN).await.unwrap();
    for r in [&a, &b] {
        let err = issuer.acquire(r, 30 * SEC).await.unwrap_err();
        assert_limit(&err, r);
        let exists: i64 = raw.exists(issuer.lock_key(r)).await.unwrap();
        assert_eq!(exists, 0, "{label}: {r} left a lock");
    }
    let now: i64 = raw.get(&counter).await.unwrap();
    assert_eq!(now, MAX_TOKEN);
}

#[tokio::test]
async fn redis_standalone_refuses_at_the_limit_and_changes_nothing() {
    let url = redis_url().await;
    let issuer = RedisIssuer::connect(&url).await.unwrap();
    redis_refuses_at_the_limit(&issuer, &mut raw(&url).await, "standalone").await;
}

/// A lost counter (Redis lost its data) starts above PostgreSQL's high-water mark: when that
/// mark is at the limit, the acquire is refused and undone, leaving neither a lock nor a
/// counter (there was none before).
#[tokio::test]
async fn redis_lost_counter_with_a_mark_at_the_limit_is_refused_and_undone() {
    let url = redis_url().await;
    let db = TestDb::new().await;
    let issuer = RedisIssuer::connect(&url)
        .await
        .unwrap()
        .with_floor_source(db.pool.clone());
    let mut raw = raw(&url).await;
    let resource = unique_resource("lost-counter");
    sqlx::query("SELECT pgfence.check($1, $2)")
        .bind(resource.as_str())
        .bind(MAX_TOKEN)
        .execute(&db.pool)
        .await
        .unwrap();
    let (lock, counter) = (issuer.lock_key(&resource), issuer.counter_key(&resource));
    for owner in ["first-owner", "second-owner"] {
        let err = issuer
            .acquire_as(&resource, owner, 30 * SEC)
            .await
            .unwrap_err();
        assert_refused(&err, &resource, true);
        let exists: i64 = raw.exists(&lock).await.unwrap();
        assert_eq!(exists, 0, "{owner}: the refused acquire left a lock");
        let exists: i64 = raw.exists(&counter).await.unwrap();
        assert_eq!(exists, 0, "{owner}: the refused acquire left a counter");
    }
    // The mark lowered (pgfence.unpoison_resource): the lock is free at once.
    sqlx::query("SELECT pgfence.unpoison_resource($1, 7)")
        .bind(resource.as_str())
        .execute(&db.pool)
        .await
        .unwrap();
    let lease = issuer.acquire(&resource, 30 * SEC).await.unwrap().unwrap();
    assert_eq!(lease.token().get(), 8);
    issuer.release(&lease).await.unwrap();
}

#[tokio::test]
async fn redis_cluster_refuses_at_the_limit_and_changes_nothing() {
    let cluster = RedisCluster::start(3).await.unwrap();
    let issuer = RedisIssuer::connect_cluster(&cluster.urls()).await.unwrap();
    let mut raw = redis::cluster::ClusterClient::new(cluster.urls())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    redis_refuses_at_the_limit(&issuer, &mut raw, "cluster").await;
}

#[tokio::test]
async fn redis_sentinel_refuses_at_the_limit_and_changes_nothing() {
    let Some(sentinel) =
        needs::<optional::Sentinel>("redis_sentinel_refuses_at_the_limit_and_changes_nothing")
    else {
        return;
    };
    let config = SentinelConfig {
        replicas: 0,
        ..SentinelConfig::default()
    };
    let set = SentinelSet::start(sentinel, "pgfence-limit", config)
        .await
        .unwrap();
    let issuer = RedisIssuer::connect_sentinel(&set.url()).await.unwrap();
    redis_refuses_at_the_limit(&issuer, &mut raw(&set.master().url()).await, "sentinel").await;
}

#[tokio::test]
async fn pg_issuer_refuses_at_the_limit_and_changes_nothing() {
    let db = TestDb::new().await;
    let issuer = PgIssuer::new(db.pool.clone());
    let resource = unique_resource("pg-limit");
    let lease = issuer.acquire(&resource, SEC).await.unwrap().unwrap();
    issuer.release(&lease).await.unwrap();
    sqlx::query("UPDATE pgfence.issuer_counter SET value = $1")
        .bind(MAX_TOKEN)
        .execute(&db.pool)
        .await
        .unwrap();
    for owner in ["first-owner", "second-owner"] {
        let err = issuer
            .acquire_as(&resource, owner, 30 * SEC)
            .await
            .unwrap_err();
        assert_limit(&err, &resource);
        let status = issuer.status(&resource).await.unwrap();
        assert_eq!(status.owner, None, "the lock stays free");
        assert_eq!(status.counter, MAX_TOKEN, "the counter is unchanged");
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM pgfence.issuer_lock")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(rows, 0, "no lock row left behind");
    }
    let err = issuer
        .acquire_wait(&resource, 30 * SEC, 10 * SEC)
        .await
        .unwrap_err();
    assert_limit(&err, &resource);
    sqlx::query("UPDATE pgfence.issuer_counter SET value = 41")
        .execute(&db.pool)
        .await
        .unwrap();
    let lease = issuer.acquire(&resource, SEC).await.unwrap().unwrap();
    assert_eq!(lease.token().get(), 42);
}

#[cfg(feature = "zk")]
mod zk {
    use super::*;
    use pgfence::issuer::ZkIssuer;
    use pgfence_testkit::optional::ZooKeeper;
    use pgfence_testkit::{Installed, ZkEnsemble};

    /// A standalone server whose zxid is `MAX_TOKEN`: every change from now on gets a zxid
    /// above the limit. Its snapshot is renamed to that zxid (a standalone server takes its
    /// last zxid from the newest snapshot's name) and its transaction logs removed.
    async fn server_at_the_limit(zk: Installed<ZooKeeper>) -> ZkEnsemble {
        let mut zk = ZkEnsemble::single(zk).await.unwrap();
        zk.kill(0).unwrap();
        let dir = zk.members()[0].dir().join("data").join("version-2");
        let mut snapshots = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if name.starts_with("log.") {
                std::fs::remove_file(&path).unwrap();
            } else if let Some(zxid) = name.strip_prefix("snapshot.") {
                snapshots.push((i64::from_str_radix(zxid, 16).unwrap(), path));
            }
        }
        snapshots.sort();
        let (_, newest) = snapshots
            .pop()
            .expect("the server took a snapshot at start");
        for (_, older) in snapshots {
            std::fs::remove_file(older).unwrap();
        }
        std::fs::rename(newest, dir.join(format!("snapshot.{MAX_TOKEN:x}"))).unwrap();
        zk.restart(0).await.unwrap();
        zk
    }

    async fn children(zk: &ZkEnsemble, dir: &str) -> (Vec<String>, Option<i32>) {
        let client = zookeeper_client::Client::connect(&zk.connect_string())
            .await
            .unwrap();
        match client.get_children(dir).await {
            Ok((names, stat)) => (names, Some(stat.cversion)),
            Err(zookeeper_client::Error::NoNode) => (Vec::new(), None),
            Err(e) => panic!("{e}"),
        }
    }

    #[tokio::test]
    async fn zk_refuses_past_the_limit_and_leaves_no_node() {
        let Some(zk) = needs::<optional::ZooKeeper>("zk_refuses_past_the_limit_and_leaves_no_node")
        else {
            return;
        };
        let zk = server_at_the_limit(zk).await;
        let url = zk.url();
        let issuer = ZkIssuer::connect(&url).await.unwrap();
        let resource = unique_resource("zk-limit");
        let dir = issuer.lock_dir(&resource);

        // No lock dir yet to read the zxid from: the node is created, and deleted again.
        let err = issuer.acquire(&resource, 30 * SEC).await.unwrap_err();
        assert_refused(&err, &resource, true);
        let (names, first) = children(&zk, &dir).await;
        assert!(names.is_empty(), "a lock node was left behind: {names:?}");
        assert_eq!(issuer.status(&resource).await.unwrap().owner, None);

        // Another owner (of another session) is refused the same way, and without a write:
        // the lock dir's children did not change again.
        let other = ZkIssuer::connect(&url).await.unwrap();
        let err = other
            .acquire_as(&resource, "second-owner", 30 * SEC)
            .await
            .unwrap_err();
        assert_limit(&err, &resource);
        let err = issuer.acquire(&resource, 30 * SEC).await.unwrap_err();
        assert_limit(&err, &resource);
        let (names, again) = children(&zk, &dir).await;
        assert!(names.is_empty(), "a lock node was left behind: {names:?}");
        assert_eq!(
            again, first,
            "a refusal at the limit created (and deleted) a lock node"
        );
    }
}

#[cfg(feature = "etcd")]
mod etcd {
    use super::*;
    use pgfence::issuer::EtcdIssuer;
    use pgfence_testkit::EtcdCluster;

    /// etcd's revision cannot be driven to 2^39 here; what a test can reach: an acquire
    /// refused because another owner holds the lock writes nothing (no revision, no lease).
    #[tokio::test]
    async fn etcd_busy_refusal_writes_nothing() {
        let Some(etcd_bin) = needs::<optional::Etcd>("etcd_busy_refusal_writes_nothing") else {
            return;
        };
        let etcd = EtcdCluster::single(etcd_bin).await.unwrap();
        let issuer = EtcdIssuer::connect(&etcd.url()).await.unwrap();
        let resource = unique_resource("etcd-busy");
        let lease = issuer.acquire(&resource, 30 * SEC).await.unwrap().unwrap();
        let before = issuer.status(&resource).await.unwrap();
        let mut leases = issuer.client().clone();
        let grants = leases.leases().await.unwrap().leases().len();
        for owner in ["second-owner", "third-owner"] {
            assert!(
                issuer
                    .acquire_as(&resource, owner, 30 * SEC)
                    .await
                    .unwrap()
                    .is_err()
            );
        }
        let after = issuer.status(&resource).await.unwrap();
        assert_eq!(after.counter, before.counter, "a refused acquire wrote");
        assert_eq!(after.token, Some(lease.token().get()));
        assert_eq!(leases.leases().await.unwrap().leases().len(), grants);
        issuer.release(&lease).await.unwrap();
    }
}
