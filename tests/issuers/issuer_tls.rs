//! The issuers' production connections, through real servers: Redis over TLS (standalone with
//! a CA file and with required client certificates, Redis Cluster, Sentinel), etcd over mutual
//! TLS, and the minimal Redis ACL (`pgfence::issuer::redis::acl_rule`) running the issuer's whole
//! surface, with a refused permission named in the error.
//!
//! Every server is a throwaway one (`pgfence_testkit`) with per-run certificates; every call
//! that could hang is bounded.

use crate::support;

use std::future::Future;
use std::time::Duration;

use pgfence::{
    Fence, Fencing, RedisIssuer, Resource, TokenIssuer, connect_issuer,
    issuer::{
        EtcdIssuer, IssuerKind, LeaseState, ReleaseOutcome,
        redis::{SENTINEL_ACL_RULE, SentinelConnections, acl_rule},
    },
};
use pgfence_testkit::{
    Certs, ClientAuth, EtcdCluster, RedisTls, RedisTlsCluster, SentinelConfig, SentinelSet,
    SentinelTls, Server, needs, optional,
};
use support::{TestDb, token, unique_resource};
use tokio::time::Instant;

const SEC: Duration = Duration::from_secs(1);

/// Fails the test instead of hanging it.
async fn bounded<T>(what: &str, secs: u64, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no result within {secs} s"))
}

/// `?cacert=CA&cert=C&key=K` for `certs` and the client certificate of `user`.
fn mtls_params(certs: &Certs, user: &str) -> String {
    let (cert, key) = certs.client(user).unwrap();
    format!(
        "?cacert={}&cert={}&key={}",
        certs.ca().display(),
        cert.display(),
        key.display()
    )
}

/// Acquire, release, acquire again: the second token is larger, and the lock really was held.
async fn leases_work(issuer: &dyn TokenIssuer, name: &str) {
    let resource = unique_resource(name);
    let first = bounded("acquire", 20, issuer.acquire(&resource, 10 * SEC))
        .await
        .unwrap()
        .expect("the lock is free");
    assert!(
        issuer.acquire(&resource, 10 * SEC).await.unwrap().is_none(),
        "held: a second acquire is refused"
    );
    assert_eq!(
        issuer.release(&first).await.unwrap(),
        ReleaseOutcome::Released
    );
    let second = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
    assert!(
        second.token() > first.token(),
        "{:?} then {:?}",
        first.token(),
        second.token()
    );
    assert_eq!(
        issuer.release(&second).await.unwrap(),
        ReleaseOutcome::Released
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_ca_file_issues_leases_and_refuses_an_unknown_ca() {
    let certs = Certs::generate().unwrap();
    let redis = RedisTls::start(&certs, ClientAuth::None).await.unwrap();

    let issuer = bounded("connect", 20, RedisIssuer::connect(&redis.url_with_ca()))
        .await
        .unwrap();
    leases_work(&issuer, "tls-ca").await;
    // The issuer URL selector routes rediss:// with its parameters the same way.
    let any = bounded("connect_issuer", 20, connect_issuer(&redis.url_with_ca()))
        .await
        .unwrap();
    assert_eq!(any.kind(), IssuerKind::Redis);
    leases_work(&*any, "tls-ca-any").await;

    // The system trust store (no cacert) and another CA both refuse the server's certificate:
    // promptly, as an error that is not worth retrying, never a panic.
    let other = Certs::generate().unwrap();
    for url in [
        redis.url(),
        format!("{}?cacert={}", redis.url(), other.ca().display()),
    ] {
        let started = Instant::now();
        let err = bounded("connect with an unknown CA", 30, RedisIssuer::connect(&url))
            .await
            .unwrap_err();
        let text = err.to_string();
        eprintln!("unknown CA: {text}");
        assert!(text.contains("certificate"), "{url}: {text}");
        assert!(!err.is_retryable(), "{url}: a refused certificate: {text}");
        assert!(
            started.elapsed() < 15 * SEC,
            "{url}: took {:?}",
            started.elapsed()
        );
    }

    // A plaintext client gets nothing from a TLS-only port.
    let plain = format!("redis://127.0.0.1:{}", redis.port());
    assert!(
        bounded("plaintext connect", 30, RedisIssuer::connect(&plain))
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_required_client_certificates() {
    let certs = Certs::generate().unwrap();
    let redis = RedisTls::start(&certs, ClientAuth::Required).await.unwrap();

    // Without a client certificate: refused, quickly, and the error says so.
    let started = Instant::now();
    let err = bounded(
        "connect without a client certificate",
        30,
        RedisIssuer::connect(&redis.url_with_ca()),
    )
    .await
    .unwrap_err();
    assert!(started.elapsed() < 15 * SEC, "took {:?}", started.elapsed());
    eprintln!("no client certificate: {err}");
    // Usually the server's alert (`CertificateRequired`, not retryable); when the client's
    // first write races the server closing the connection, the I/O error of that write.
    let text = err.to_string().to_lowercase();
    if text.contains("certificate") {
        assert!(!err.is_retryable(), "{err}");
    } else {
        assert!(
            ["reset", "closed", "broken pipe"]
                .iter()
                .any(|w| text.contains(w)),
            "{err}"
        );
    }

    // A certificate of another CA is refused too.
    let other = Certs::generate().unwrap();
    let (cert, key) = other.client("intruder").unwrap();
    let foreign = format!(
        "{}&cert={}&key={}",
        redis.url_with_ca(),
        cert.display(),
        key.display()
    );
    assert!(
        bounded(
            "connect with a foreign certificate",
            30,
            RedisIssuer::connect(&foreign)
        )
        .await
        .is_err()
    );

    // With one: leases, extend, status and keep-alive work.
    let url = format!("{}{}", redis.url(), mtls_params(&certs, "pgfence-app"));
    let issuer = bounded("connect", 20, RedisIssuer::connect(&url))
        .await
        .unwrap();
    leases_work(&issuer, "tls-mtls").await;
    let resource = unique_resource("tls-mtls-keep");
    let mut lease = issuer
        .acquire(&resource, Duration::from_millis(300))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        issuer
            .extend(&mut lease, Duration::from_millis(300))
            .await
            .unwrap(),
        LeaseState::Held
    );
    let keep = issuer.keep_alive(&lease);
    tokio::time::sleep(Duration::from_millis(900)).await;
    let status = issuer.status(&resource).await.unwrap();
    assert_eq!(status.owner.as_deref(), Some(lease.owner()), "kept alive");
    assert!(keep.deadline().is_some());
    keep.stop();
    assert!(issuer.release(&lease).await.unwrap().is_released());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_over_tls() {
    let certs = Certs::generate().unwrap();
    let cluster = RedisTlsCluster::start(&certs, 3).await.unwrap();
    let mut nodes = cluster.urls();
    // The CA on one node URL applies to every node.
    nodes[0] = format!("{}?cacert={}", nodes[0], certs.ca().display());
    let issuer = bounded("connect_cluster", 30, RedisIssuer::connect_cluster(&nodes))
        .await
        .unwrap();
    // Enough resources to land on every node's slots.
    for i in 0..12 {
        bounded(
            "cluster leases",
            30,
            leases_work(&issuer, &format!("tls-cluster-{i}")),
        )
        .await;
    }
    // Without the CA the nodes' certificates are not trusted.
    let err = bounded(
        "connect_cluster without the CA",
        30,
        RedisIssuer::connect_cluster(&cluster.urls()),
    )
    .await
    .unwrap_err();
    assert!(
        err.to_string().to_lowercase().contains("certificate")
            || err.to_string().contains("connect"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_over_tls() {
    let Some(sentinel) = needs::<optional::Sentinel>("sentinel_over_tls") else {
        return;
    };
    let certs = Certs::generate().unwrap();
    let set = SentinelTls::start(sentinel, &certs, "tlsmaster")
        .await
        .unwrap();
    let conns = bounded("open", 30, SentinelConnections::open(&set.url_with_ca()))
        .await
        .unwrap();
    assert_eq!(
        conns.master_addr(),
        Some(format!("127.0.0.1:{}", set.master().port()))
    );
    assert!(conns.url().tls);
    leases_work(&RedisIssuer::new(conns), "tls-sentinel").await;
    let issuer = bounded(
        "connect_sentinel",
        30,
        RedisIssuer::connect_sentinel(&set.url_with_ca()),
    )
    .await
    .unwrap();
    leases_work(&issuer, "tls-sentinel-issuer").await;
    let any = bounded("connect_issuer", 30, connect_issuer(&set.url_with_ca()))
        .await
        .unwrap();
    leases_work(&*any, "tls-sentinel-any").await;

    // The same sentinel without TLS, or without the CA: refused.
    let plain = set
        .url()
        .replacen("rediss+sentinel://", "redis+sentinel://", 1);
    assert!(
        bounded("plaintext sentinel", 30, connect_issuer(&plain))
            .await
            .is_err()
    );
    assert!(
        bounded("sentinel without the CA", 30, connect_issuer(&set.url()))
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_over_mutual_tls() {
    let Some(etcd_bin) = needs::<optional::Etcd>("etcd_over_mutual_tls") else {
        return;
    };
    let certs = Certs::generate().unwrap();
    let etcd = EtcdCluster::start_tls(etcd_bin, 1, &certs).await.unwrap();
    assert!(etcd.url().starts_with("etcd+https://"), "{}", etcd.url());

    let url = format!("{}{}", etcd.url(), mtls_params(&certs, "pgfence-app"));
    let issuer = bounded("connect", 20, EtcdIssuer::connect(&url))
        .await
        .unwrap();
    assert!(issuer.endpoints()[0].starts_with("https://"));
    leases_work(&issuer, "etcd-tls").await;
    let any = bounded("connect_issuer", 20, connect_issuer(&url))
        .await
        .unwrap();
    assert_eq!(any.kind(), IssuerKind::Etcd);
    leases_work(&*any, "etcd-tls-any").await;

    // Without a client certificate (or without the CA) no request gets through: an error, in
    // bounded time.
    let ca_only = format!("{}?cacert={}", etcd.url(), certs.ca().display());
    for (url, unknown_ca) in [(ca_only, false), (etcd.url(), true)] {
        let started = Instant::now();
        let outcome = bounded("etcd without a client certificate", 40, async {
            let issuer = EtcdIssuer::connect(&url).await?;
            issuer
                .acquire(&unique_resource("etcd-no-cert"), 5 * SEC)
                .await
        })
        .await;
        let err = outcome.expect_err(&url);
        eprintln!("etcd {url}: {err}");
        // The server's certificate refused here is not worth retrying. (The server refusing
        // ours shows up as its alert or as a closed stream, whichever the client meets first.)
        if unknown_ca {
            assert!(err.to_string().contains("UnknownIssuer"), "{err}");
            assert!(!err.is_retryable(), "{url}: a refused certificate: {err}");
        }
        assert!(
            started.elapsed() < 30 * SEC,
            "{url}: took {:?}",
            started.elapsed()
        );
    }
    // Plain etcd:// to the TLS port fails too, and TLS files on etcd:// are refused.
    let plain = etcd.url().replacen("etcd+https://", "etcd://", 1);
    let err = EtcdIssuer::connect(&format!("{plain}?cacert={}", certs.ca().display()))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            pgfence::Error::Invalid(pgfence::error::InvalidInput::Tls(_))
        ),
        "{err}"
    );
}

/// Runs `ACL SETUSER user on >password <rules>` on a plaintext throwaway Redis.
async fn set_user(admin: &mut redis::aio::MultiplexedConnection, user: &str, rules: &str) {
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER")
        .arg(user)
        .arg("reset")
        .arg("on")
        .arg(">pw");
    for rule in rules.split_whitespace() {
        cmd.arg(rule);
    }
    let () = cmd.query_async(admin).await.unwrap();
}

/// The denials `ACL LOG` recorded, as `(reason, object)`, apart from `client|setinfo` (which
/// redis-rs sends on Redis 7.2+ and whose refusal it ignores: see `redis::ACL_COMMANDS`).
async fn acl_denials(admin: &mut redis::aio::MultiplexedConnection) -> Vec<(String, String)> {
    let entries: Vec<std::collections::HashMap<String, redis::Value>> = redis::cmd("ACL")
        .arg("LOG")
        .query_async(admin)
        .await
        .unwrap();
    let text = |v: Option<&redis::Value>| match v {
        Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(redis::Value::SimpleString(s)) => s.clone(),
        other => format!("{other:?}"),
    };
    entries
        .iter()
        .map(|e| (text(e.get("reason")), text(e.get("object"))))
        .filter(|(_, object)| object != "client|setinfo")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_acl_runs_the_whole_issuer() {
    let db = TestDb::new().await;
    let server = Server::redis().await.unwrap();
    let admin_client = redis::Client::open(server.url()).unwrap();
    let mut admin = admin_client
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    set_user(&mut admin, "pgfence-app", &acl_rule("pgfence")).await;
    set_user(&mut admin, "billing-app", &acl_rule("billing")).await;
    let () = redis::cmd("ACL")
        .arg("LOG")
        .arg("RESET")
        .query_async(&mut admin)
        .await
        .unwrap();

    let port = server.port();
    // Database 1 (SELECT) with the default prefix; database 0 with a custom prefix.
    let default = RedisIssuer::connect(&format!("redis://pgfence-app:pw@127.0.0.1:{port}/1"))
        .await
        .unwrap()
        .with_floor_source(db.pool.clone());
    let billing = RedisIssuer::connect(&format!("redis://billing-app:pw@127.0.0.1:{port}/0"))
        .await
        .unwrap()
        .with_key_prefix("billing")
        .unwrap();
    assert_eq!(billing.acl_rule(), acl_rule("billing"));

    for (issuer, name) in [(&default, "acl-default"), (&billing, "acl-billing")] {
        leases_work(issuer, name).await;
        let resource = unique_resource(name);
        // acquire_wait: waits while held, gets the lock once it is released.
        let held = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
        let waiter = {
            let (issuer, resource) = (issuer.clone(), resource.clone());
            tokio::spawn(async move { issuer.acquire_wait(&resource, 10 * SEC, 10 * SEC).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        issuer.release(&held).await.unwrap();
        let mut next = bounded("acquire_wait", 15, waiter)
            .await
            .unwrap()
            .unwrap()
            .expect("got the lock after the release");
        assert!(next.token() > held.token());
        // extend, status, keep-alive.
        assert_eq!(
            issuer
                .extend(&mut next, Duration::from_millis(300))
                .await
                .unwrap(),
            LeaseState::Held
        );
        let keep = issuer.keep_alive(&next);
        tokio::time::sleep(Duration::from_millis(800)).await;
        let status = issuer.status(&resource).await.unwrap();
        assert_eq!(status.owner.as_deref(), Some(next.owner()));
        assert_eq!(status.counter, next.token().get());
        keep.stop();
        assert!(issuer.release(&next).await.unwrap().is_released());
        // raise_floor, reseed and recover_from.
        assert_eq!(issuer.raise_floor(&resource, 50).await.unwrap(), 50);
        assert_eq!(issuer.reseed(&db.pool, &resource).await.unwrap(), 50);
        let stale = pgfence::Error::StaleToken {
            target: pgfence::error::StaleTarget::Resource(resource.to_string()),
            presented: 1,
            current: 70,
            other_counter: false,
        };
        assert!(issuer.recover_from(&stale).await.unwrap());
        let lease = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
        assert_eq!(lease.token().get(), 71);
        issuer.release(&lease).await.unwrap();
    }

    // A fresh counter below Postgres's high-water mark is reissued past it (the reissue
    // script), with the floor source.
    let fresh = unique_resource("acl-fresh");
    Fence::new(db.pool.clone())
        .check(&db.pool, &fresh, Fencing::new(token(100)))
        .await
        .unwrap();
    let lease = default.acquire(&fresh, 10 * SEC).await.unwrap().unwrap();
    assert_eq!(
        lease.token().get(),
        101,
        "reissued past the high-water mark"
    );
    default.release(&lease).await.unwrap();

    // Connections the server closed: the next call reconnects and the others are probed
    // (PING); all of it within the rule.
    let () = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("USER")
        .arg("pgfence-app")
        .query_async(&mut admin)
        .await
        .map(|_: i64| ())
        .unwrap();
    let resource = unique_resource("acl-reconnect");
    let status = bounded("status after the kill", 10, default.status(&resource))
        .await
        .unwrap();
    assert_eq!(status.counter, 0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    leases_work(&default, "acl-after-kill").await;

    assert_eq!(
        acl_denials(&mut admin).await,
        Vec::<(String, String)>::new(),
        "the documented rule must cover everything the issuer sent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_acl_permission_is_named() {
    let server = Server::redis().await.unwrap();
    let admin_client = redis::Client::open(server.url()).unwrap();
    let mut admin = admin_client
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let port = server.port();
    let resource = Resource::new("acl:refused").unwrap();

    // The keys of another prefix only.
    set_user(&mut admin, "wrong-keys", &acl_rule("other")).await;
    let issuer = RedisIssuer::connect(&format!("redis://wrong-keys:pw@127.0.0.1:{port}"))
        .await
        .unwrap();
    let started = Instant::now();
    let err = issuer
        .acquire_wait(&resource, 10 * SEC, 10 * SEC)
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < 5 * SEC,
        "not retried: {:?}",
        started.elapsed()
    );
    assert!(
        matches!(err, pgfence::Error::RedisPermission { .. }),
        "{err}"
    );
    assert!(!err.is_retryable());
    let text = err.to_string();
    eprintln!("wrong keys: {text}");
    for needed in ["~pgfence:*", "+evalsha", "+script|load", "Redis ACL"] {
        assert!(text.contains(needed), "{needed} missing from: {text}");
    }
    // The same user, with the prefix it may use, works: the error was about the keys.
    let other = issuer.clone().with_key_prefix("other").unwrap();
    leases_work(&other, "acl-other").await;
    // A custom prefix names its own pattern.
    let billing = issuer.clone().with_key_prefix("billing").unwrap();
    let err = billing.status(&resource).await.unwrap_err();
    assert!(err.to_string().contains("~billing:*"), "{err}");

    // A command missing inside a script (INCR): refused by the script, named the same way.
    let no_incr = acl_rule("pgfence").replace(" +incr", "");
    set_user(&mut admin, "no-incr", &no_incr).await;
    let issuer = RedisIssuer::connect(&format!("redis://no-incr:pw@127.0.0.1:{port}"))
        .await
        .unwrap();
    let err = issuer.acquire(&resource, 10 * SEC).await.unwrap_err();
    assert!(
        matches!(err, pgfence::Error::RedisPermission { .. }),
        "{err}"
    );
    eprintln!("no incr: {err}");
    assert!(err.to_string().contains("+incr"), "{err}");
    // ... and a missing top-level command (PTTL, in status).
    let no_pttl = acl_rule("pgfence").replace(" +pttl", "");
    set_user(&mut admin, "no-pttl", &no_pttl).await;
    let issuer = RedisIssuer::connect(&format!("redis://no-pttl:pw@127.0.0.1:{port}"))
        .await
        .unwrap();
    let err = issuer.status(&resource).await.unwrap_err();
    assert!(
        matches!(err, pgfence::Error::RedisPermission { .. }),
        "{err}"
    );

    // ... and SELECT, when connecting to another database.
    let no_select = acl_rule("pgfence").replace(" +select", "");
    set_user(&mut admin, "no-select", &no_select).await;
    let err = RedisIssuer::connect(&format!("redis://no-select:pw@127.0.0.1:{port}/2"))
        .await
        .unwrap_err();
    eprintln!("no select: {err}");
    assert!(
        matches!(err, pgfence::Error::RedisPermission { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("+select"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_acls_through_sentinel() {
    let Some(sentinel) = needs::<optional::Sentinel>("the_documented_acls_through_sentinel") else {
        return;
    };
    let config = SentinelConfig {
        replicas: 0,
        ..SentinelConfig::default()
    };
    let set = SentinelSet::start(sentinel, "aclmaster", config)
        .await
        .unwrap();
    // With no replica to wait for, the set may return before its sentinel listens.
    let connect = |port: u16| async move {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
        let give_up = Instant::now() + 10 * SEC;
        loop {
            match client.get_multiplexed_async_connection().await {
                Ok(conn) => return conn,
                Err(e) if Instant::now() < give_up => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("port {port}: {e}"),
            }
        }
    };
    let mut master = connect(set.master().port()).await;
    let mut sentinel = connect(set.sentinels()[0].port()).await;
    set_user(&mut master, "app", &acl_rule("pgfence")).await;
    set_user(&mut sentinel, "sentinel-app", SENTINEL_ACL_RULE).await;
    set_user(&mut sentinel, "no-perm", "-@all").await;
    for conn in [&mut master, &mut sentinel] {
        let () = redis::cmd("ACL")
            .arg("LOG")
            .arg("RESET")
            .query_async(conn)
            .await
            .unwrap();
    }

    let hosts = set.url().replacen("redis+sentinel://", "", 1);
    let url = format!(
        "redis+sentinel://app:pw@{hosts}?sentinel_username=sentinel-app&sentinel_password=pw"
    );
    let issuer = bounded("connect_sentinel", 20, RedisIssuer::connect_sentinel(&url))
        .await
        .unwrap();
    leases_work(&issuer, "acl-sentinel").await;
    let resource = unique_resource("acl-sentinel-status");
    assert_eq!(issuer.status(&resource).await.unwrap().counter, 0);
    assert_eq!(
        acl_denials(&mut master).await,
        Vec::<(String, String)>::new()
    );
    assert_eq!(
        acl_denials(&mut sentinel).await,
        Vec::<(String, String)>::new()
    );

    // A sentinel user that may not ask: refused at once (not after the failover wait),
    // naming the sentinels' rule.
    let refused = url.replacen(
        "sentinel_username=sentinel-app",
        "sentinel_username=no-perm",
        1,
    );
    let started = Instant::now();
    let err = bounded(
        "refused sentinel user",
        20,
        RedisIssuer::connect_sentinel(&refused),
    )
    .await
    .unwrap_err();
    eprintln!("sentinel refused: {err}");
    assert!(started.elapsed() < 3 * SEC, "took {:?}", started.elapsed());
    assert!(
        matches!(&err, pgfence::Error::RedisPermission { rule, .. } if rule == SENTINEL_ACL_RULE),
        "{err}"
    );
    // A master user without ROLE: refused at once, naming the issuer's rule.
    set_user(
        &mut master,
        "no-role",
        &acl_rule("pgfence").replace(" +role", ""),
    )
    .await;
    let no_role = url.replacen("app:pw@", "no-role:pw@", 1);
    let err = bounded(
        "refused master user",
        20,
        RedisIssuer::connect_sentinel(&no_role),
    )
    .await
    .unwrap_err();
    eprintln!("master refused: {err}");
    assert!(
        matches!(&err, pgfence::Error::RedisPermission { rule, .. } if rule.contains("+role")),
        "{err}"
    );
}
