//! Every issuer call has a time bound (`docs/issuers.md`, "Time bounds"): through a black hole
//! (a proxy that stops forwarding; connections stay open, bytes wait) an acquire fails within
//! its bound instead of hanging, and a PostgreSQL or Redis acquire held up on the way and
//! delivered after the heal leaves no lock behind.

use crate::support;

use std::num::NonZeroUsize;
use std::time::Duration;

#[cfg(feature = "etcd")]
use pgfence::issuer::EtcdIssuer;
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
    // Redis knows the acquire script (a fresh server would answer a held `EVALSHA` with
    // NOSCRIPT, and the late attempts a test waits for would change nothing).
    let lease = issuer
        .acquire(&resource, Duration::from_secs(5))
        .await
        .unwrap()
        .expect("the warm-up resource is free");
    issuer.release(&lease).await.unwrap();
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
    black_holed_redis_acquire_heals(true).await;
}

/// The same through `acquire`, whose owner id is the call's own: the script records no attempt
/// (`acquire` saves that write) and the clean-up goes by the owner id alone.
#[tokio::test]
async fn redis_black_holed_acquire_with_its_own_owner_leaves_no_lock_after_the_heal() {
    black_holed_redis_acquire_heals(false).await;
}

/// The black hole and the heal; `acquire_as` with a caller's owner id, or `acquire`.
async fn black_holed_redis_acquire_heals(callers_owner: bool) {
    let (proxy, issuer) = redis_behind_proxy().await;
    let direct = RedisIssuer::connect(&support::redis_url().await)
        .await
        .unwrap();
    let resource = unique_resource("redis-black-hole-heal");
    let before = direct.status(&resource).await.unwrap().counter;
    let hold = Duration::from_secs(4);
    proxy.pause(hold);
    let start = Instant::now();
    let ttl = Duration::from_secs(30);
    let outcome = timeout(Duration::from_secs(20), async {
        if callers_owner {
            issuer.acquire_as(&resource, "zombie", ttl).await.map(drop)
        } else {
            issuer.acquire(&resource, ttl).await.map(drop)
        }
    })
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

/// An etcd issuer whose connections all go through a fresh proxy, and one that goes straight to
/// the same etcd (to look under the black hole).
#[cfg(feature = "etcd")]
async fn etcd_behind_proxy(
    etcd: crate::issuer_suite::Shared<pgfence_testkit::optional::Etcd>,
) -> (std::sync::Arc<Proxy>, EtcdIssuer, EtcdIssuer) {
    let url = crate::etcd_issuer::etcd_url(etcd).await;
    let first = url.trim_start_matches("etcd://");
    let first = first.rsplit_once('@').map_or(first, |(_, h)| h);
    let first = first.split(',').next().unwrap();
    let proxy = Proxy::start(port_of(&format!("etcd://{first}"))).unwrap();
    let issuer = EtcdIssuer::connect(&format!("etcd://127.0.0.1:{}", proxy.port()))
        .await
        .unwrap();
    issuer
        .status(&unique_resource("warm"))
        .await
        .expect("etcd through the proxy");
    let direct = EtcdIssuer::connect(&url).await.unwrap();
    (std::sync::Arc::new(proxy), issuer, direct)
}

/// A `tracing` layer for this thread (`#[tokio::test]` runs the issuer and its background
/// tasks on it) that sees the etcd issuer's events: on its first "granted an etcd lease"
/// (the lease grant of an acquire answered, its transaction about to go out) it runs `on_grant`
/// once, and it keeps the messages of the events that follow.
#[cfg(feature = "etcd")]
struct EtcdEvents {
    on_grant: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
    seen: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

#[cfg(feature = "etcd")]
impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for EtcdEvents {
    fn register_callsite(
        &self,
        metadata: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        if metadata.target() == "pgfence::issuer" {
            tracing::subscriber::Interest::always()
        } else {
            tracing::subscriber::Interest::never()
        }
    }

    fn enabled(
        &self,
        metadata: &tracing::Metadata<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        metadata.target() == "pgfence::issuer"
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        if message.0.starts_with("granted an etcd lease")
            && let Some(hook) = self.on_grant.lock().unwrap().take()
        {
            hook();
        }
        self.seen.lock().unwrap().push(message.0);
    }
}

/// Black-holes the proxy right after the first etcd lease grant of this thread, until the
/// heal `hold` later. `replies_first`: the replies at once, so the acquire's transaction still
/// reaches etcd and takes the lock but its answer is held, and the requests too from 200 ms
/// later, so that what the failed call sends next (its clean-up) is held until the heal;
/// otherwise both ways at once (the transaction itself is held). Returns the event messages
/// seen so far, and the guard of the thread's subscriber.
#[cfg(feature = "etcd")]
fn black_hole_after_the_grant(
    proxy: &std::sync::Arc<Proxy>,
    hold: Duration,
    replies_first: bool,
) -> (
    std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    tracing::subscriber::DefaultGuard,
) {
    use pgfence_testkit::Direction;
    use tracing_subscriber::layer::SubscriberExt;
    let proxy = proxy.clone();
    let seen = std::sync::Arc::default();
    let layer = EtcdEvents {
        on_grant: std::sync::Mutex::new(Some(Box::new(move || {
            if !replies_first {
                proxy.pause(hold);
                return;
            }
            proxy.pause_one_way(Direction::ToClient, hold);
            let later = Duration::from_millis(200);
            std::thread::spawn(move || {
                std::thread::sleep(later);
                proxy.pause_one_way(Direction::ToServer, hold - later);
            });
        }))),
        seen: std::sync::Arc::clone(&seen),
    };
    let guard = tracing::subscriber::set_default(tracing_subscriber::registry().with(layer));
    (seen, guard)
}

/// Waits (at most `within`) until `seen` has a message containing `what`.
#[cfg(feature = "etcd")]
async fn wait_for_event(seen: &std::sync::Mutex<Vec<String>>, what: &str, within: Duration) {
    let give_up = Instant::now() + within;
    while !seen.lock().unwrap().iter().any(|m| m.contains(what)) {
        assert!(
            Instant::now() < give_up,
            "no {what:?} within {within:?}: {:?}",
            seen.lock().unwrap()
        );
        sleep(Duration::from_millis(50)).await;
    }
}

/// An etcd acquire whose transaction reached etcd and took the lock, but whose answer was
/// black-holed (and then everything it sent) fails at its bound; its clean-up, the revoke of
/// the etcd lease the call granted, is held in the black hole with the rest, re-sent as the
/// connections die, and goes through after the heal: the lock is then gone at once, not held
/// by nobody until its 30 s TTL.
#[cfg(feature = "etcd")]
#[tokio::test]
async fn etcd_black_holed_acquire_leaves_no_lock_after_the_heal() {
    let Some(etcd) =
        crate::etcd_issuer::needs_etcd("etcd_black_holed_acquire_leaves_no_lock_after_the_heal")
    else {
        return;
    };
    let (proxy, issuer, direct) = etcd_behind_proxy(etcd).await;
    let bound = Duration::from_millis(1500);
    let issuer = issuer.with_call_timeout(bound);
    let resource = unique_resource("etcd-black-hole-heal");
    let hold = Duration::from_secs(4);
    let (seen, _events) = black_hole_after_the_grant(&proxy, hold, true);
    let start = Instant::now();
    let err = timeout(
        Duration::from_secs(20),
        issuer.acquire_as(&resource, "zombie", Duration::from_secs(30)),
    )
    .await
    .expect("the acquire hung")
    .expect_err("acquired through a black hole");
    assert!(err.is_retryable(), "{err}");
    assert!(start.elapsed() < bound + MARGIN, "{:?}", start.elapsed());
    // The transaction got through: the lock is taken, for a caller told the call failed.
    let during = direct.status(&resource).await.unwrap();
    assert_eq!(during.owner.as_deref(), Some("zombie"), "{during:?}");

    // The heal; then the clean-up gets through (at most a second's pause between re-sends).
    let free = loop {
        let status = direct.status(&resource).await.unwrap();
        if status.owner.is_none() {
            break start.elapsed();
        }
        assert!(
            start.elapsed() < hold + Duration::from_secs(5),
            "a lock nobody holds after the heal: {status:?}; events: {:?}",
            seen.lock().unwrap()
        );
        sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "etcd acquire black-holed for {hold:?}: the lock it took was gone {free:?} after the start"
    );
    assert!(
        free >= hold - MARGIN,
        "the clean-up went through the black hole: {free:?}"
    );
    let lease = direct
        .acquire_as(&resource, "other", Duration::from_secs(5))
        .await
        .unwrap()
        .expect("the lock is free");
    direct.release(&lease).await.unwrap();
}

/// The clean-up of a failed etcd acquire revokes only the leases that call granted: when the
/// same owner acquires again through a path that works (as `acquire_wait` or a caller
/// re-sending `acquire_as` does), it adopts the lock the failed call's transaction took (same
/// token) and binds it to a new etcd lease of its own, so the revoke that goes through after
/// the heal leaves that lease alone.
#[cfg(feature = "etcd")]
#[tokio::test]
async fn etcd_clean_up_of_a_failed_acquire_spares_the_same_owners_later_lease() {
    let Some(etcd) = crate::etcd_issuer::needs_etcd(
        "etcd_clean_up_of_a_failed_acquire_spares_the_same_owners_later_lease",
    ) else {
        return;
    };
    let (proxy, issuer, direct) = etcd_behind_proxy(etcd).await;
    let issuer = issuer.with_call_timeout(Duration::from_millis(1500));
    let resource = unique_resource("etcd-black-hole-same-owner");
    let hold = Duration::from_secs(4);
    let (seen, _events) = black_hole_after_the_grant(&proxy, hold, true);
    let err = timeout(
        Duration::from_secs(20),
        issuer.acquire_as(&resource, "same-owner", Duration::from_secs(30)),
    )
    .await
    .expect("the acquire hung")
    .expect_err("acquired through a black hole");
    assert!(err.is_retryable(), "{err}");
    // The same owner, through a path that works, before the heal: it adopts the lock.
    let taken = direct.status(&resource).await.unwrap();
    assert_eq!(taken.owner.as_deref(), Some("same-owner"), "{taken:?}");
    let lease = direct
        .acquire_as(&resource, "same-owner", Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the owner's own lock");
    assert_eq!(
        taken.token,
        Some(lease.token().get()),
        "adopted, same token"
    );
    // The heal, and the failed call's clean-up: wait until it has answered, then some.
    wait_for_event(&seen, "of a failed acquire", hold + Duration::from_secs(6)).await;
    sleep(Duration::from_millis(500)).await;
    let status = direct.status(&resource).await.unwrap();
    assert_eq!(status.owner.as_deref(), Some("same-owner"), "{status:?}");
    assert_eq!(status.token, Some(lease.token().get()), "{status:?}");
    assert_eq!(
        direct.release(&lease).await.unwrap(),
        pgfence::issuer::ReleaseOutcome::Released
    );
}

/// An etcd acquire black-holed both ways right after its lease grant: its transaction is held
/// on the way, and so is the clean-up the failed call sends. After the heal both reach etcd, in
/// either order (re-sent revokes go out on new connections): a transaction that comes first
/// takes the lock and the revoke deletes it; one that comes after the revoke fails, its lease
/// gone (etcd may also drop it, the client having cancelled it). Either way no lock is left.
#[cfg(feature = "etcd")]
#[tokio::test]
async fn etcd_late_transaction_of_a_failed_acquire_leaves_no_lock() {
    let Some(etcd) =
        crate::etcd_issuer::needs_etcd("etcd_late_transaction_of_a_failed_acquire_leaves_no_lock")
    else {
        return;
    };
    let (proxy, issuer, direct) = etcd_behind_proxy(etcd).await;
    let bound = Duration::from_millis(1500);
    let issuer = issuer.with_call_timeout(bound);
    let resource = unique_resource("etcd-late-txn");
    let hold = Duration::from_secs(3);
    let (seen, _events) = black_hole_after_the_grant(&proxy, hold, false);
    let start = Instant::now();
    let err = timeout(
        Duration::from_secs(20),
        issuer.acquire_as(&resource, "late", Duration::from_secs(30)),
    )
    .await
    .expect("the acquire hung")
    .expect_err("acquired through a black hole");
    assert!(err.is_retryable(), "{err}");
    assert!(start.elapsed() < bound + MARGIN, "{:?}", start.elapsed());
    assert_eq!(direct.status(&resource).await.unwrap().owner, None);
    // The heal; the clean-up answers; then time for a late transaction to land.
    wait_for_event(&seen, "of a failed acquire", hold + Duration::from_secs(6)).await;
    sleep(Duration::from_secs(1)).await;
    let status = direct.status(&resource).await.unwrap();
    eprintln!(
        "etcd acquire black-holed both ways for {hold:?}, healed: {status:?}; events {:?}",
        seen.lock().unwrap()
    );
    assert_eq!(status.owner, None, "a lock nobody holds: {status:?}");
}
