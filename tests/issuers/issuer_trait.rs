//! The lease semantics every issuer shares, checked through `Arc<dyn TokenIssuer>` (as a CLI
//! or a service that picks its issuer from a URL holds it) on Redis: `lease_semantics` of the
//! shared suite in `issuer_suite`, which `etcd_through_the_trait` (`etcd_issuer.rs`),
//! `zk_through_the_trait` (`zk_issuer.rs`) and `pg_through_the_trait` (`pg_issuer.rs`) run on
//! the other issuers. Also Redis's floor and recovery through the trait, bad prefixes and
//! URLs, and keep-alive with a concrete issuer. The suite's other tests run on Redis in
//! `issuer.rs`.

use crate::issuer_suite;
use crate::support;

use std::sync::Arc;
use std::time::Duration;

use pgfence::{
    Error, TokenIssuer, connect_issuer,
    issuer::{IssuerKind, IssuerOptions, KeepAlive, ReleaseOutcome, connect_issuer_with},
};
use support::{TestDb, redis_url, unique_resource};
use tokio::time::Instant;

const SEC: Duration = Duration::from_secs(1);

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
        target: pgfence::error::StaleTarget::Resource(resource.to_string()),
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
async fn bad_prefixes_and_urls_are_refused() {
    let issuer = support::issuer().await;
    let long = "x".repeat(pgfence::issuer::limits::MAX_KEY_PREFIX_LEN + 1);
    for bad in ["", "a b", "a{b", "b}", "tab\there", "nl\n", long.as_str()] {
        let err = issuer.clone().with_key_prefix(bad).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Invalid(pgfence::error::InvalidInput::KeyPrefix(_))
            ),
            "{bad:?}: {err}"
        );
    }
    let max = "y".repeat(pgfence::issuer::limits::MAX_KEY_PREFIX_LEN);
    for good in ["myapp", "my-app:prod", "a", max.as_str()] {
        assert_eq!(
            issuer.clone().with_key_prefix(good).unwrap().key_prefix(),
            good
        );
    }
    assert!(matches!(
        connect_issuer("memcached://127.0.0.1").await,
        Err(Error::Invalid(pgfence::error::InvalidInput::IssuerUrl(_)))
    ));
    assert!(matches!(
        connect_issuer_with(&redis_url().await, IssuerOptions::new().key_prefix("{x}")).await,
        Err(Error::Invalid(pgfence::error::InvalidInput::KeyPrefix(_)))
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

/// `RedisIssuer::keep_alive` still works, and `KeepAlive::spawn` takes a concrete issuer too.
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

/// A Redis URL that does not parse is quoted, password hidden, with the part that is wrong
/// (not "Redis URL did not parse - InvalidClientConfig"); a Redis nobody listens at names
/// host:port and says it refused. Never the password.
#[tokio::test]
async fn redis_url_and_connection_errors_name_the_host() {
    let err = connect_issuer("redis://:s3cret@cache.internal:notaport")
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Invalid(pgfence::error::InvalidInput::IssuerUrl(_))
        ),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains(
            "the Redis URL \"redis://:***@cache.internal:notaport\" did not parse: the port \"notaport\" is not a number"
        ),
        "{text}"
    );
    let err = pgfence::RedisIssuer::connect("cache.internal:6379")
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("the Redis URL \"cache.internal:6379\" did not parse: it has no scheme"),
        "{err}"
    );
    let err = pgfence::RedisIssuer::connect("u:s3cret@cache.internal:6379")
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("\"u:***@cache.internal:6379\""),
        "{err}"
    );
    assert!(
        !text.contains("InvalidClientConfig") && !text.contains("s3cret"),
        "{text}"
    );
    for url in [
        "redis://:s3cret@127.0.0.1:1",
        "rediss://:s3cret@127.0.0.1:1",
    ] {
        let started = Instant::now();
        let err = connect_issuer(url).await.unwrap_err();
        assert!(err.is_retryable(), "{url}: {err:?}");
        // The whole chain, as `{:#}` prints it: the refusal once, not as a time-out.
        let text = format!("{:#}", anyhow::Error::from(err));
        assert!(
            text.contains("Redis at 127.0.0.1:1 refused the connection"),
            "{url}: {text}"
        );
        assert_eq!(text.to_lowercase().matches("refused").count(), 1, "{text}");
        assert!(!text.contains("did not answer"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
        assert!(started.elapsed() < 3 * SEC, "{:?}", started.elapsed());
    }
}

/// A Redis that takes the connection and never answers is a time-out, said as one (after the
/// 5 s bound), not a refusal.
#[tokio::test]
async fn a_redis_that_never_answers_is_a_time_out() {
    // The kernel completes the handshake; nothing ever reads or writes.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://127.0.0.1:{}", silent.local_addr().unwrap().port());
    let started = Instant::now();
    let err = tokio::time::timeout(60 * SEC, connect_issuer(&url))
        .await
        .expect("connect is bounded")
        .unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    let text = format!("{:#}", anyhow::Error::from(err));
    let addr = url.trim_start_matches("redis://");
    assert!(
        text.contains(&format!("Redis at {addr} did not answer within 5s")),
        "{text}"
    );
    assert!(!text.to_lowercase().contains("refused"), "{text}");
    assert!(started.elapsed() >= 4 * SEC, "{:?}", started.elapsed());
    drop(silent);
}
