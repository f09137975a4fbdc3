//! Key prefixes isolate PostgreSQL too: two prefixes sharing one Redis and one database share
//! no resource mark, no check and no audit filter.

use crate::support;

use std::time::Duration;

use pgfence::{Effects, Fence, Fencing, RedisIssuer, Resource, TokenIssuer, audit::AuditFilter};
use redis::AsyncCommands;
use support::{TestDb, redis_url, unique_resource};

const TTL: Duration = Duration::from_secs(10);

async fn prefixed(prefix: &str) -> RedisIssuer {
    RedisIssuer::connect(&redis_url().await)
        .await
        .unwrap()
        .with_key_prefix(prefix)
        .unwrap()
}

/// One checked transaction of `lease`: check `resource`, insert a row into `table`.
async fn checked_write(
    db: &TestDb,
    fence: &Fence,
    table: &str,
    resource: &Resource,
    lease: &pgfence::Lease,
) -> pgfence::Result<()> {
    let mut tx = db.pool.begin().await.unwrap();
    fence.check(&mut *tx, resource, lease).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (token) VALUES ($1)"
    )))
    .bind(lease.token().get())
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    Ok(())
}

/// B's leases check and write up to token 6; A's first lease (token 1) on the same resource
/// name is still accepted: its mark is its own.
#[tokio::test]
async fn another_prefix_marks_do_not_fence_out_a_lease() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE a_ledger (id bigserial PRIMARY KEY, token bigint NOT NULL)")
        .await;
    db.exec("CREATE TABLE b_ledger (id bigserial PRIMARY KEY, token bigint NOT NULL)")
        .await;
    let fence = Fence::new(db.pool.clone());
    let (a, b) = (prefixed("app_a").await, prefixed("app_b").await);
    let resource = unique_resource("iso");

    for _ in 0..6 {
        let lease = b.acquire(&resource, TTL).await.unwrap().unwrap();
        checked_write(&db, &fence, "b_ledger", &resource, &lease)
            .await
            .unwrap();
        b.release(&lease).await.unwrap();
    }
    let la = a.acquire(&resource, TTL).await.unwrap().unwrap();
    assert_eq!(la.token().get(), 1);
    checked_write(&db, &fence, "a_ledger", &resource, &la)
        .await
        .expect("A's own first lease is not fenced out by B's marks");
    let rows: Vec<i64> = sqlx::query_scalar("SELECT token FROM a_ledger")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, vec![1]);
    a.release(&la).await.unwrap();
}

/// A rejection of one prefix's lease is audited under that prefix's name: the audit filter of
/// the prefix lists it, the other prefix's filter does not (and the other way round).
#[tokio::test]
async fn audit_rows_carry_the_prefix_name() {
    let db = TestDb::new().await;
    let fence = Fence::new(db.pool.clone());
    let (a, b) = (prefixed("app_a").await, prefixed("app_b").await);
    let resource = unique_resource("iso-audit");

    // Each prefix: a newer lease checks, an older one of the same prefix is rejected.
    for (issuer, prefix) in [(&a, "app_a"), (&b, "app_b")] {
        let old = issuer.acquire(&resource, TTL).await.unwrap().unwrap();
        issuer.release(&old).await.unwrap();
        let new = issuer.acquire(&resource, TTL).await.unwrap().unwrap();
        fence.check(&db.pool, &resource, &new).await.unwrap();
        let err = fence.check(&db.pool, &resource, &old).await.unwrap_err();
        let named = format!("{prefix}{{{resource}");
        assert_eq!(old.fencing_resource().as_str(), named);
        let pgfence::Error::StaleToken { target, .. } = &err else {
            panic!("expected StaleToken, got {err:?}");
        };
        assert_eq!(target.resource(), Some(named.as_str()), "{err:?}");
        // Recovery is the rejected prefix's: the other issuer leaves its counter alone.
        let other = if prefix == "app_a" { &b } else { &a };
        assert!(!other.recover_from(&err).await.unwrap());
        issuer.release(&new).await.unwrap();
    }
    let rows = |prefix: &'static str| {
        let pool = db.pool.clone();
        let pattern = resource.to_string();
        async move {
            let filter = AuditFilter {
                resource: Some(pattern),
                ..AuditFilter::default()
            }
            .in_key_prefix(prefix)
            .unwrap();
            pgfence::audit::list(&pool, &filter)
                .await
                .unwrap()
                .into_iter()
                .map(|r| r.resource.unwrap())
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(rows("app_a").await, vec![format!("app_a{{{resource}")]);
    assert_eq!(rows("app_b").await, vec![format!("app_b{{{resource}")]);
    // The default prefix's filter: neither (no default-prefix lease was rejected).
    assert!(rows("pgfence").await.is_empty());
    // A pattern of the prefix's too.
    let filter = AuditFilter {
        resource: Some("iso-audit:*".into()),
        ..AuditFilter::default()
    }
    .in_key_prefix("app_a")
    .unwrap();
    assert_eq!(filter.resource.as_deref(), Some("app_a{iso-audit:*"));
    let listed = pgfence::audit::list(&db.pool, &filter).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
}

/// A's floor source reads A's marks only: B's higher marks on the same resource name (or the
/// same domain) do not raise A's lost counter, and A's own marks do.
#[tokio::test]
async fn floor_source_reads_its_own_prefix_marks() {
    let db = TestDb::new().await;
    let fence = Fence::new(db.pool.clone());
    let url = redis_url().await;
    let a = prefixed("app_a").await.with_floor_source(db.pool.clone());
    let b = prefixed("app_b").await.with_floor_source(db.pool.clone());
    let plain = unique_resource("iso-floor");
    let domain = format!("isod{}", rand::random::<u32>());
    let in_domain = Resource::in_domain(&domain, "x").unwrap();

    for resource in [&plain, &in_domain] {
        for _ in 0..6 {
            let lease = b.acquire(resource, TTL).await.unwrap().unwrap();
            fence.check(&db.pool, resource, &lease).await.unwrap();
            b.release(&lease).await.unwrap();
        }
        // A's fresh counter is not raised by B's marks.
        let first = a.acquire(resource, TTL).await.unwrap().unwrap();
        assert_eq!(first.token().get(), 1, "{resource}");
        a.release(&first).await.unwrap();
        for _ in 0..2 {
            let lease = a.acquire(resource, TTL).await.unwrap().unwrap();
            fence.check(&db.pool, resource, &lease).await.unwrap();
            a.release(&lease).await.unwrap();
        }
        let named = resource.in_key_prefix("app_a").unwrap();
        assert_eq!(
            pgfence::admin::counter_floor(&db.pool, &named)
                .await
                .unwrap(),
            3
        );
        assert_eq!(
            pgfence::admin::counter_floor(&db.pool, &resource.in_key_prefix("app_b").unwrap())
                .await
                .unwrap(),
            6
        );
        // Nothing under the bare name: neither prefix is the default.
        assert_eq!(
            pgfence::admin::counter_floor(&db.pool, resource)
                .await
                .unwrap(),
            0
        );
        // A loses its counter: the floor source restarts it above A's marks (3), not B's (6).
        let _: () = redis::Client::open(url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
            .del(a.counter_key(resource))
            .await
            .unwrap();
        let lease = a.acquire(resource, TTL).await.unwrap().unwrap();
        assert_eq!(lease.token().get(), 4, "{resource}");
        fence.check(&db.pool, resource, &lease).await.unwrap();
        a.release(&lease).await.unwrap();
        // reseed reads the prefix's marks too.
        assert_eq!(b.reseed(&db.pool, resource).await.unwrap(), 6);
        assert_eq!(
            TokenIssuer::reseed(&a, &db.pool, resource).await.unwrap(),
            4
        );
    }
    // SQL sees the prefix's domain as `app_a{D`.
    let mark: i64 = sqlx::query_scalar("SELECT pgfence.domain_high_water($1)")
        .bind(format!("app_a{{{domain}"))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(mark, 4);
}

/// The effect ledger's scope is the prefix's too: B's newer lease does not fence A's out of
/// the same work item, and their idempotency keys differ.
#[tokio::test]
async fn effects_are_scoped_by_prefix() {
    let db = TestDb::new().await;
    let (a, b) = (prefixed("app_a").await, prefixed("app_b").await);
    let resource = unique_resource("iso-effect");
    let effects = Effects::new(db.pool.clone());
    let mut last = None;
    for _ in 0..3 {
        let lease = b.acquire(&resource, TTL).await.unwrap().unwrap();
        last = Some(
            effects
                .begin(&db.pool, &lease, "invoice:1", "charge")
                .await
                .unwrap(),
        );
        b.release(&lease).await.unwrap();
    }
    let la = a.acquire(&resource, TTL).await.unwrap().unwrap();
    let mine = effects
        .begin(&db.pool, &la, "invoice:1", "charge")
        .await
        .expect("B's leases do not fence A's effect");
    assert_ne!(mine.idempotency_key(), last.unwrap().idempotency_key());
    a.release(&la).await.unwrap();
}

/// The default prefix keeps its names: a lease is fenced under its resource, marks and audit
/// rows keep the names they always had.
#[tokio::test]
async fn default_prefix_names_are_unchanged() {
    let db = TestDb::new().await;
    let fence = Fence::new(db.pool.clone());
    let default = RedisIssuer::connect(&redis_url().await).await.unwrap();
    let explicit = prefixed("pgfence").await;
    for resource in [
        unique_resource("iso-default"),
        Resource::in_domain(&format!("isodd{}", rand::random::<u32>()), "x").unwrap(),
    ] {
        for issuer in [&default, &explicit] {
            let lease = issuer.acquire(&resource, TTL).await.unwrap().unwrap();
            assert_eq!(lease.fencing_resource(), &resource);
            assert_eq!(Fencing::from(&lease).resource.as_ref(), Some(&resource));
            fence.check(&db.pool, &resource, &lease).await.unwrap();
            assert_eq!(
                fence.high_water(&resource).await.unwrap(),
                lease.token().get()
            );
            issuer.release(&lease).await.unwrap();
        }
    }
    // A prefix's PostgreSQL name is not a resource to lock.
    let named = unique_resource("iso-named").in_key_prefix("app_a").unwrap();
    assert!(matches!(
        default.acquire(&named, TTL).await,
        Err(pgfence::Error::Invalid(
            pgfence::error::InvalidInput::Resource(_)
        ))
    ));
    // A resumed lease is the default prefix's until told otherwise.
    let resumed = pgfence::Lease::resume(named.without_key_prefix(), "o", support::token(1));
    assert_eq!(resumed.fencing_resource(), resumed.resource());
    assert_eq!(
        resumed.with_key_prefix("app_a").unwrap().fencing_resource(),
        &named
    );
}

/// `doctor` compares each mark with the counter of its own key prefix: a prefix's lost counter
/// is found with that prefix's issuer, and another prefix's marks are named, not misread.
#[tokio::test]
async fn doctor_reads_each_prefix_s_marks_against_its_own_counters() {
    let db = TestDb::new().await;
    let fence = Fence::new(db.pool.clone());
    let a = prefixed("app_a").await;
    let resource = unique_resource("doc");
    for _ in 0..3 {
        let lease = a.acquire(&resource, TTL).await.unwrap().unwrap();
        let mut tx = db.pool.begin().await.unwrap();
        fence.check(&mut *tx, &resource, &lease).await.unwrap();
        tx.commit().await.unwrap();
        a.release(&lease).await.unwrap();
    }
    // app_a's counter is lost (a Redis failover).
    let mut redis = redis::Client::open(redis_url().await)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis.del(a.counter_key(&resource)).await.unwrap();
    let options = pgfence::admin::DoctorOptions::default();
    let findings = pgfence::admin::doctor(&db.pool, Some(&a), &options)
        .await
        .unwrap();
    assert!(
        findings
            .iter()
            .any(|f| f.kind == pgfence::admin::FindingKind::CounterBelowMark
                && f.object == format!("resource {resource} (key prefix app_a)")),
        "{findings:?}"
    );
    // The default prefix's issuer does not compare app_a's mark with its own counter.
    let default = RedisIssuer::connect(&redis_url().await).await.unwrap();
    let findings = pgfence::admin::doctor(&db.pool, Some(&default), &options)
        .await
        .unwrap();
    assert!(
        !findings
            .iter()
            .any(|f| f.kind == pgfence::admin::FindingKind::CounterBelowMark),
        "{findings:?}"
    );
    assert!(
        findings.iter().any(
            |f| f.kind == pgfence::admin::FindingKind::CountersNotChecked
                && f.message.contains("other key prefixes")
                && f.message.contains("1 under key prefix app_a")
                && f.suggestion
                    .as_deref()
                    .is_some_and(|s| s.contains("pgfence doctor --key-prefix app_a"))
        ),
        "{findings:?}"
    );
}

/// The PostgreSQL issuer starts a new counter above its own prefix's marks (0.3).
#[tokio::test]
async fn the_postgres_issuer_seeds_a_new_counter_from_its_own_prefix_marks() {
    let db = TestDb::new().await;
    let resource = unique_resource("pgseed");
    let named = resource.in_key_prefix("app_a").unwrap();
    sqlx::query("SELECT pgfence.check($1, 7, 0)")
        .bind(named.as_str())
        .execute(&db.pool)
        .await
        .unwrap();
    let a = pgfence::issuer::PgIssuer::new(db.pool.clone())
        .with_key_prefix("app_a")
        .unwrap();
    let lease = a.acquire(&resource, TTL).await.unwrap().unwrap();
    assert_eq!(lease.token().get(), 8, "above app_a's mark 7");
    let default = pgfence::issuer::PgIssuer::new(db.pool.clone());
    let lease = default.acquire(&resource, TTL).await.unwrap().unwrap();
    assert_eq!(
        lease.token().get(),
        1,
        "the default prefix has no mark for it"
    );
}
