//! Leases survive what managed Redis does to connections: a server `timeout` that closes idle
//! connections, connections closed under the client, a pause shorter than the lease's
//! remaining time. A lease is reported lost only when Redis says so, or when its local deadline
//! passes without a renewal.
//!
//! Every test starts its own throwaway Redis (a `timeout` setting is per server) and, where it
//! breaks connections, a loopback proxy in front of it.

use crate::support;

use std::num::NonZeroUsize;
use std::time::Duration;

use pgfence::{
    RedisIssuer,
    issuer::{LeaseLost, LeaseState, ReleaseOutcome},
};
use pgfence_testkit::{Proxy, Server};
use support::unique_resource;
use tokio::time::{Instant, sleep, timeout};

/// More connections than a small CI machine has CPUs: every one of them goes idle and is closed.
fn four() -> NonZeroUsize {
    NonZeroUsize::new(4).unwrap()
}

/// Long enough for a Redis with `timeout 1` to close an idle connection (it counts idleness in
/// whole seconds, so 1 s of idleness is not always enough).
const IDLE: Duration = Duration::from_millis(2200);

async fn redis_with_idle_timeout() -> Server {
    Server::redis_with(&["--timeout", "1"])
        .await
        .expect("throwaway Redis")
}

/// The lock's holder as Redis sees it, on a connection of its own (not through any proxy).
async fn holder(server: &Server, resource: &pgfence::Resource) -> Option<String> {
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("GET")
        .arg(pgfence::issuer::redis::lock_key(resource))
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// `pgfence run --ttl 3s -- sleep 5` against a Redis with `timeout 1`: the keep-alive's
/// connections are idle longer than the server allows between renewals, so every renewal
/// meets a closed connection first. The lease must still never be reported lost.
#[tokio::test]
async fn keep_alive_survives_a_server_idle_timeout() {
    let server = redis_with_idle_timeout().await;
    let issuer = RedisIssuer::connect_with(&server.url(), four())
        .await
        .unwrap();
    let resource = unique_resource("idle-keepalive");
    let lease = issuer
        .acquire(&resource, Duration::from_secs(3))
        .await
        .unwrap()
        .unwrap();
    let mut keep = issuer.keep_alive(&lease);
    let lost = timeout(Duration::from_secs(5), keep.lost()).await;
    assert!(lost.is_err(), "lease reported lost: {lost:?}");
    assert!(keep.deadline().unwrap() > lease.deadline(), "renewed");
    keep.stop();
    assert_eq!(
        holder(&server, &resource).await.as_deref(),
        Some(format!("{}:{}", lease.owner(), lease.token()).as_str())
    );
    assert_eq!(
        issuer.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert_eq!(holder(&server, &resource).await, None);
}

/// Idle longer than the server's `timeout`, then extend, release and acquire: each finds every
/// connection closed and must not surface that.
#[tokio::test]
async fn calls_after_idleness_do_not_fail() {
    let server = redis_with_idle_timeout().await;
    let issuer = RedisIssuer::connect_with(&server.url(), four())
        .await
        .unwrap();
    let resource = unique_resource("idle-calls");
    let mut lease = issuer
        .acquire(&resource, Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    sleep(IDLE).await;
    assert_eq!(
        issuer
            .extend(&mut lease, Duration::from_secs(10))
            .await
            .unwrap(),
        LeaseState::Held
    );
    sleep(IDLE).await;
    assert_eq!(
        issuer.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    sleep(IDLE).await;
    let again = issuer
        .acquire(&resource, Duration::from_secs(10))
        .await
        .expect("acquire after idleness")
        .expect("free");
    assert!(again.token() > lease.token());
    assert_eq!(
        issuer.release(&again).await.unwrap(),
        ReleaseOutcome::Released
    );
}

/// Every connection is closed under the client again and again (at varying points, some of
/// them while a renewal is in flight) while a 1.5 s lease is kept alive for 5 s.
#[tokio::test]
async fn keep_alive_survives_dropped_connections() {
    let server = Server::redis().await.expect("throwaway Redis");
    let proxy = Proxy::start(server.port()).unwrap();
    let issuer = RedisIssuer::connect_with(&proxy.redis_url(), four())
        .await
        .unwrap();
    let resource = unique_resource("dropped");
    let lease = issuer
        .acquire(&resource, Duration::from_millis(1500))
        .await
        .unwrap()
        .unwrap();
    let mut keep = issuer.keep_alive(&lease);
    let accepted = proxy.accepted();
    let start = Instant::now();
    let mut drops = 0;
    while start.elapsed() < Duration::from_secs(5) {
        let nap = Duration::from_millis(300 + rand::random::<u64>() % 500);
        tokio::select! {
            lost = keep.lost() => panic!("lease reported lost after {drops} drops: {lost}"),
            () = sleep(nap) => {}
        }
        proxy.drop_connections();
        drops += 1;
    }
    assert!(drops >= 6, "{drops} drops");
    assert!(
        proxy.accepted() > accepted,
        "the issuer reconnected through the proxy"
    );
    assert!(keep.deadline().unwrap() > Instant::now(), "still held");
    keep.stop();
    proxy.drop_connections();
    assert_eq!(
        issuer.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert_eq!(holder(&server, &resource).await, None);
}

/// A stall shorter than the lease's remaining time (a failover pause) costs nothing, even
/// when it holds up a renewal for longer than the renewal interval.
#[tokio::test]
async fn keep_alive_survives_a_short_pause() {
    let server = Server::redis().await.expect("throwaway Redis");
    let proxy = Proxy::start(server.port()).unwrap();
    let issuer = RedisIssuer::connect_with(&proxy.redis_url(), four())
        .await
        .unwrap();
    let resource = unique_resource("short-pause");
    let lease = issuer
        .acquire(&resource, Duration::from_millis(1500))
        .await
        .unwrap()
        .unwrap();
    let mut keep = issuer.keep_alive(&lease);
    for _ in 0..3 {
        renewed(&keep).await; // 1.5 s left
        proxy.pause(Duration::from_millis(900)); // the next renewal (in 0.5 s) waits 0.4 s
        let lost = timeout(Duration::from_millis(1200), keep.lost()).await;
        assert!(lost.is_err(), "lease reported lost: {lost:?}");
    }
    keep.stop();
    assert_eq!(
        issuer.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
}

/// Redis stalls for longer than the lease has left: the loss is reported when the local
/// deadline passes — not before, and not a response timeout later.
#[tokio::test]
async fn keep_alive_reports_a_long_stall_at_the_deadline() {
    let server = Server::redis().await.expect("throwaway Redis");
    let proxy = Proxy::start(server.port()).unwrap();
    let issuer = RedisIssuer::connect_with(&proxy.redis_url(), four())
        .await
        .unwrap();
    let resource = unique_resource("long-pause");
    let lease = issuer
        .acquire(&resource, Duration::from_millis(900))
        .await
        .unwrap()
        .unwrap();
    let mut keep = issuer.keep_alive(&lease);
    sleep(Duration::from_millis(400)).await; // one renewal (every 300 ms)
    let deadline = keep.deadline().unwrap();
    assert!(deadline > lease.deadline(), "renewed before the stall");
    proxy.pause(Duration::from_secs(4));
    let lost = timeout(Duration::from_secs(3), keep.lost())
        .await
        .expect("loss reported");
    let at = Instant::now();
    assert!(matches!(lost, LeaseLost::Unreachable(_)), "{lost:?}");
    assert!(
        at + Duration::from_millis(50) >= deadline,
        "reported {:?} before the deadline",
        deadline - at
    );
    assert!(
        at <= deadline + Duration::from_millis(400),
        "reported {:?} after the deadline",
        at - deadline
    );
    assert!(keep.deadline().is_none());
}

/// Waits until the keep-alive has just renewed the lease.
async fn renewed(keep: &pgfence::issuer::KeepAlive) {
    let before = keep.deadline().expect("held");
    while keep.deadline().expect("held") == before {
        sleep(Duration::from_millis(2)).await;
    }
}

/// Redis cannot be reached at all (connections refused): lost at the deadline, as above.
#[tokio::test]
async fn keep_alive_reports_an_unreachable_redis_at_the_deadline() {
    let server = Server::redis().await.expect("throwaway Redis");
    let proxy = Proxy::start(server.port()).unwrap();
    let issuer = RedisIssuer::connect_with(&proxy.redis_url(), four())
        .await
        .unwrap();
    let resource = unique_resource("refused");
    let lease = issuer
        .acquire(&resource, Duration::from_millis(900))
        .await
        .unwrap()
        .unwrap();
    let mut keep = issuer.keep_alive(&lease);
    sleep(Duration::from_millis(400)).await;
    let deadline = keep.deadline().unwrap();
    drop(proxy); // listener closed, connections closed: every reconnect is refused
    let lost = timeout(Duration::from_secs(3), keep.lost())
        .await
        .expect("loss reported");
    let at = Instant::now();
    assert!(matches!(lost, LeaseLost::Unreachable(_)), "{lost:?}");
    assert!(
        at + Duration::from_millis(50) >= deadline,
        "reported {:?} before the deadline",
        deadline - at
    );
    assert!(
        at <= deadline + Duration::from_millis(400),
        "reported {:?} after the deadline",
        at - deadline
    );
}

/// A definitive answer is never retried into something else: a taken lock is reported taken
/// at once, even while connections keep dropping.
#[tokio::test]
async fn a_taken_lock_is_reported_taken_not_retried() {
    let server = Server::redis().await.expect("throwaway Redis");
    let proxy = Proxy::start(server.port()).unwrap();
    let issuer = RedisIssuer::connect_with(&proxy.redis_url(), four())
        .await
        .unwrap();
    let resource = unique_resource("taken");
    let lease = issuer
        .acquire(&resource, Duration::from_millis(600))
        .await
        .unwrap()
        .unwrap();
    let mut keep = issuer.keep_alive(&lease);
    let mut direct = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let () = redis::cmd("SET")
        .arg(pgfence::issuer::redis::lock_key(&resource))
        .arg("someone-else:999")
        .query_async(&mut direct)
        .await
        .unwrap();
    proxy.drop_connections();
    let lost = timeout(Duration::from_secs(2), keep.lost())
        .await
        .expect("loss reported");
    assert_eq!(lost, LeaseLost::Taken);
    assert_eq!(
        issuer.release(&lease).await.unwrap(),
        ReleaseOutcome::TakenByOther
    );
}
