//! Every issuer call has a time bound (`docs/issuers.md`, "Time bounds"): through a black hole
//! (a proxy that stops forwarding; connections stay open, bytes wait) an acquire fails within
//! its bound instead of hanging, and a PostgreSQL or Redis acquire held up on the way and
//! delivered after the heal leaves no lock behind.

use crate::support;

use std::num::NonZeroUsize;
use std::time::Duration;

use pgfence::issuer::{DEFAULT_CALL_TIMEOUT, PgIssuer};
use pgfence::{RedisIssuer, TokenIssuer};
use pgfence_testkit::Proxy;
use support::{TestDb, unique_resource};
use tokio::time::{Instant, sleep, timeout};

/// What a call may take past its bound (scheduling, the first attempt's minimum).
const MARGIN: Duration = Duration::from_millis(400);

/// The port of a `redis://host:port[/db]` URL.
fn port_of(url: &str) -> u16 {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let host_port = rest.split(['/', '?']).next().unwrap_or(rest);
    host_port
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or(6379)
}

/// A Redis issuer whose connections all go through a fresh proxy, every connection used once.
async fn redis_behind_proxy() -> (Proxy, RedisIssuer) {
    let proxy = Proxy::start(port_of(&support::redis_url().await)).unwrap();
    let issuer = RedisIssuer::connect_with(&proxy.redis_url(), NonZeroUsize::new(2).unwrap())
        .await
        .unwrap();
    let resource = unique_resource("warm");
    for _ in 0..2 {
        issuer.status(&resource).await.unwrap();
    }
    (proxy, issuer)
}

/// Acquires through a black hole; the error and how long it took (never a hang).
async fn black_holed_acquire<I: TokenIssuer>(issuer: &I, owner: &str) -> (String, Duration) {
    let resource = unique_resource("black-hole");
    let start = Instant::now();
    let outcome = timeout(
        Duration::from_secs(20),
        issuer.acquire_as(&resource, owner, Duration::from_secs(30)),
    )
    .await
    .expect("the acquire hung");
    let elapsed = start.elapsed();
    let err = match outcome {
        Err(e) => e,
        Ok(got) => panic!("acquired through a black hole: {got:?}"),
    };
    assert!(err.is_retryable(), "the outcome is unknown: {err}");
    (err.to_string(), elapsed)
}

/// Redis with the default bound: each of the 3 acquire attempts is cut off after 1 s, as the
/// re-send policy's comment says (it used to take 3 × the 5 s response timeout).
#[tokio::test]
async fn redis_acquire_through_a_black_hole_gives_up_after_three_one_second_attempts() {
    let (proxy, issuer) = redis_behind_proxy().await;
    assert_eq!(issuer.call_timeout(), DEFAULT_CALL_TIMEOUT);
    proxy.pause(Duration::from_secs(30));
    let (err, elapsed) = black_holed_acquire(&issuer, "bh-default").await;
    eprintln!("Redis acquire through a black hole, default bound: {elapsed:?}: {err}");
    assert!(err.contains("no reply from Redis within 1s"), "{err}");
    assert!(
        elapsed >= Duration::from_millis(2900) && elapsed < Duration::from_secs(3) + MARGIN,
        "{elapsed:?}"
    );
}

/// Redis with a bound shorter than its attempts: the call ends at the bound.
#[tokio::test]
async fn redis_acquire_through_a_black_hole_returns_within_the_configured_bound() {
    let (proxy, issuer) = redis_behind_proxy().await;
    let bound = Duration::from_millis(1500);
    let issuer = issuer.with_call_timeout(bound);
    proxy.pause(Duration::from_secs(30));
    let (err, elapsed) = black_holed_acquire(&issuer, "bh-short").await;
    eprintln!("Redis acquire through a black hole, bound {bound:?}: {elapsed:?}: {err}");
    assert!(err.contains("no reply from Redis"), "{err}");
    assert!(
        elapsed >= bound - MARGIN && elapsed < bound + MARGIN,
        "{elapsed:?}"
    );
    // Releases and status reads are bounded the same way.
    let resource = unique_resource("black-hole-status");
    let start = Instant::now();
    assert!(issuer.status(&resource).await.is_err());
    assert!(start.elapsed() < bound + MARGIN, "{:?}", start.elapsed());
}

/// A Redis acquire black-holed on every connection fails after its three cut-off attempts;
/// when the black hole heals, the attempts held on the way reach Redis and take the lock for
/// an owner that was told the call failed — and the clean-up the failed call queued behind
/// them on each connection removes it at once: the lock is free, not held by nobody until its
/// 30 s TTL.
#[tokio::test]
async fn redis_black_holed_acquire_leaves_no_lock_after_the_heal() {
    let (proxy, issuer) = redis_behind_proxy().await;
    let direct = RedisIssuer::connect(&support::redis_url().await)
        .await
        .unwrap();
    let resource = unique_resource("redis-black-hole-heal");
    let before = direct.status(&resource).await.unwrap().counter;
    let hold = Duration::from_secs(4);
    proxy.pause(hold);
    let start = Instant::now();
    let outcome = timeout(
        Duration::from_secs(20),
        issuer.acquire_as(&resource, "zombie", Duration::from_secs(30)),
    )
    .await
    .expect("the acquire hung");
    let err = outcome.expect_err("acquired through a black hole");
    assert!(err.is_retryable(), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(3) + MARGIN,
        "{:?}",
        start.elapsed()
    );
    assert_eq!(direct.status(&resource).await.unwrap().owner, None);

    // The heal, then time for every held attempt (and what follows it) to reach Redis.
    sleep(hold + Duration::from_secs(1)).await;
    let status = direct.status(&resource).await.unwrap();
    assert!(
        status.counter > before,
        "the held attempts never reached Redis: {status:?}"
    );
    eprintln!(
        "Redis acquire black-holed for {hold:?}, healed: {status:?} {:?} after the start",
        start.elapsed()
    );
    assert_eq!(status.owner, None, "a lock nobody holds: {status:?}");
    let lease = direct
        .acquire_as(&resource, "other", Duration::from_secs(5))
        .await
        .unwrap()
        .expect("the lock is free");
    direct.release(&lease).await.unwrap();
}

/// The clean-up of a failed acquire removes only the lock that call took: when the same owner
/// acquires again through a path that works (as `acquire_wait` or a caller re-sending
/// `acquire_as` does) before the failed call's held attempts arrive, the late attempts and the
/// clean-up behind them leave that newer lease alone.
#[tokio::test]
async fn redis_clean_up_of_a_failed_acquire_spares_the_same_owners_later_lease() {
    let (proxy, issuer) = redis_behind_proxy().await;
    let direct = RedisIssuer::connect(&support::redis_url().await)
        .await
        .unwrap();
    let resource = unique_resource("redis-black-hole-same-owner");
    let hold = Duration::from_secs(4);
    proxy.pause(hold);
    let err = timeout(
        Duration::from_secs(20),
        issuer.acquire_as(&resource, "same-owner", Duration::from_secs(30)),
    )
    .await
    .expect("the acquire hung")
    .expect_err("acquired through a black hole");
    assert!(err.is_retryable(), "{err}");
    // The same owner, through a path that works, before the heal.
    let lease = direct
        .acquire_as(&resource, "same-owner", Duration::from_secs(30))
        .await
        .unwrap()
        .expect("free before the heal");
    let before = direct.status(&resource).await.unwrap().counter;
    assert_eq!(before, lease.token().get());
    // The heal: the failed call's attempts adopt the lock (same owner, same token, no new
    // one), then its clean-up runs; wait for both, then some.
    sleep(hold + Duration::from_secs(1)).await;
    let status = direct.status(&resource).await.unwrap();
    assert_eq!(status.owner.as_deref(), Some("same-owner"), "{status:?}");
    assert_eq!(status.token, Some(lease.token().get()), "{status:?}");
    assert_eq!(
        direct.release(&lease).await.unwrap(),
        pgfence::issuer::ReleaseOutcome::Released
    );
}

/// Waits until every connection of the issuer's pool is idle (sqlx returns one to the pool in
/// the background, after a ping), so that the next call takes one that is open now.
async fn back_in_the_pool(issuer: &PgIssuer) {
    let pool = issuer.pool();
    let until = Instant::now() + Duration::from_secs(5);
    while pool.num_idle() < pool.size() as usize {
        assert!(Instant::now() < until, "a connection never came back");
        sleep(Duration::from_millis(10)).await;
    }
}

/// The rollbacks PostgreSQL counted in the current database.
async fn rollbacks(db: &TestDb) -> i64 {
    sqlx::query_scalar::<_, i64>(
        "SELECT xact_rollback FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// A PostgreSQL acquire whose connection is black-holed fails within its bound; when the
/// black hole heals and the held statement reaches the server, it runs in a transaction that
/// never commits: no lock is left that nobody holds, and another owner gets the lock at once.
#[tokio::test]
async fn pg_black_holed_acquire_is_bounded_and_leaves_no_lock_after_the_heal() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(db.options.get_port()).unwrap();
    let url = format!(
        "postgres://{}@127.0.0.1:{}/{}",
        db.options.get_username(),
        proxy.port(),
        db.name
    );
    let bound = Duration::from_secs(1);
    let issuer = PgIssuer::connect(&url)
        .await
        .unwrap()
        .with_call_timeout(bound);
    let direct = PgIssuer::new(db.pool.clone());
    let resource = unique_resource("pg-black-hole");
    // The pool's one connection is open (and idle) when the black hole starts.
    issuer.status(&resource).await.unwrap();
    back_in_the_pool(&issuer).await;
    let before = rollbacks(&db).await;

    let hold = Duration::from_secs(3);
    proxy.pause_open(hold);
    let start = Instant::now();
    let outcome = timeout(
        Duration::from_secs(20),
        issuer.acquire_as(&resource, "zombie", Duration::from_secs(60)),
    )
    .await
    .expect("the acquire hung");
    let elapsed = start.elapsed();
    let err = outcome.expect_err("acquired through a black hole");
    eprintln!("PostgreSQL acquire through a black hole, bound {bound:?}: {elapsed:?}: {err}");
    assert!(err.is_retryable(), "{err}");
    assert!(
        err.to_string().contains("no reply from PostgreSQL"),
        "{err}"
    );
    assert!(elapsed < bound + MARGIN, "{elapsed:?}");

    // The heal: the held statement is delivered, then the closed connection.
    sleep(hold.saturating_sub(elapsed)).await;
    // Until the server has run it: rolled back (or, were it committed, holding the lock).
    let delivered = Instant::now() + Duration::from_secs(10);
    loop {
        let status = direct.status(&resource).await.unwrap();
        assert_eq!(status.owner, None, "a lock nobody holds: {status:?}");
        if rollbacks(&db).await > before {
            break;
        }
        assert!(
            Instant::now() < delivered,
            "the held acquire never reached the server"
        );
        sleep(Duration::from_millis(50)).await;
    }
    let lease = direct
        .acquire_as(&resource, "other", Duration::from_secs(5))
        .await
        .unwrap()
        .expect("the lock is free");
    direct.release(&lease).await.unwrap();
    // The issuer itself works again on new connections.
    let lease = issuer
        .acquire(&resource, Duration::from_secs(5))
        .await
        .unwrap()
        .expect("free");
    issuer.release(&lease).await.unwrap();
}

/// Extend and release through a black hole are bounded too, and a held extend delivered late
/// moves no expiry.
#[tokio::test]
async fn pg_black_holed_extend_and_release_are_bounded() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(db.options.get_port()).unwrap();
    let url = format!(
        "postgres://{}@127.0.0.1:{}/{}",
        db.options.get_username(),
        proxy.port(),
        db.name
    );
    let bound = Duration::from_millis(800);
    let issuer = PgIssuer::connect(&url)
        .await
        .unwrap()
        .with_call_timeout(bound);
    let direct = PgIssuer::new(db.pool.clone());
    let resource = unique_resource("pg-black-hole-extend");
    let ttl = Duration::from_secs(4);
    let mut lease = issuer.acquire(&resource, ttl).await.unwrap().expect("free");
    back_in_the_pool(&issuer).await;
    let hold = Duration::from_secs(2);
    proxy.pause_open(hold);
    let start = Instant::now();
    let extended = issuer.extend(&mut lease, Duration::from_secs(60)).await;
    assert!(extended.is_err(), "{extended:?}");
    assert!(start.elapsed() < bound + MARGIN, "{:?}", start.elapsed());
    // After the heal (while the lock is still held) the held extend reaches the server and is
    // rolled back: the lock still lapses at the end of its original TTL.
    sleep((ttl + Duration::from_millis(500)).saturating_sub(start.elapsed())).await;
    let status = direct.status(&resource).await.unwrap();
    assert_eq!(
        status.owner, None,
        "a late extend kept the lock: {status:?}"
    );
    // Release (of the lapsed lease) returns within the bound through a fresh black hole.
    issuer.status(&resource).await.unwrap();
    back_in_the_pool(&issuer).await;
    proxy.pause_open(Duration::from_secs(2));
    let start = Instant::now();
    let _ = issuer.release(&lease).await;
    assert!(start.elapsed() < bound + MARGIN, "{:?}", start.elapsed());
}

/// A connection closed while it is being set up (here: a proxy whose server is down, as a
/// reset would) fails before the server's answer to the TLS request; sqlx reports it as
/// `unexpected response from SSLRequest: 0x00`, a protocol error, which is transient: the
/// next connection may well work.
#[tokio::test]
async fn a_connection_closed_during_the_tls_request_is_retryable() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_port = closed.local_addr().unwrap().port();
    drop(closed);
    let proxy = Proxy::start(dead_port).unwrap();
    let url = format!("{}?sslmode=prefer", proxy.postgres_url());
    let err = sqlx::PgPool::connect(&url)
        .await
        .expect_err("connected to a server that is down");
    assert!(
        err.to_string().contains("SSLRequest"),
        "not the handshake error: {err}"
    );
    let err = pgfence::Error::from(err);
    assert!(err.is_retryable(), "{err}");
}

/// A one-way partition (`Proxy::pause_one_way`): with only Redis's replies held, the acquire
/// runs on the server and takes the lock while its caller, hearing nothing, fails at its
/// bound; once the replies flow again, the clean-up queued behind it frees the lock. With
/// only the requests held, nothing reaches Redis until the heal, and then the clean-up runs
/// right after the late acquire.
#[tokio::test]
async fn redis_one_way_partitions_leave_no_lock_after_the_heal() {
    use pgfence_testkit::Direction;
    for direction in [Direction::ToClient, Direction::ToServer] {
        let (proxy, issuer) = redis_behind_proxy().await;
        let issuer = issuer.with_call_timeout(Duration::from_millis(800));
        let direct = RedisIssuer::connect(&support::redis_url().await)
            .await
            .unwrap();
        let resource = unique_resource("redis-one-way");
        let hold = Duration::from_secs(2);
        proxy.pause_one_way(direction, hold);
        let start = Instant::now();
        let err = timeout(
            Duration::from_secs(20),
            issuer.acquire_as(&resource, "one-way", Duration::from_secs(30)),
        )
        .await
        .expect("the acquire hung")
        .expect_err("acquired through a one-way partition");
        assert!(err.is_retryable(), "{direction:?}: {err}");
        assert!(
            start.elapsed() < Duration::from_millis(800) + MARGIN,
            "{direction:?}"
        );
        let during = direct.status(&resource).await.unwrap();
        match direction {
            // The request went through: the lock is taken, for a caller told it failed.
            Direction::ToClient => assert_eq!(during.owner.as_deref(), Some("one-way")),
            Direction::ToServer => assert_eq!(during.owner, None, "{during:?}"),
        }
        sleep(hold + Duration::from_secs(1)).await;
        let after = direct.status(&resource).await.unwrap();
        assert!(
            after.counter > 0,
            "{direction:?}: never reached Redis: {after:?}"
        );
        assert_eq!(
            after.owner, None,
            "{direction:?}: a lock nobody holds: {after:?}"
        );
    }
}
