//! Idle expiry (`docs/issuers.md`, "Idle expiry"): many resources locked once and left idle
//! past the expiry leave no issuer state behind, counted on the real server, and the next
//! lease of each writes with a token its rows and marks accept (or, where no mark tells the
//! floor, heals with one `recover_from`).

use std::time::Duration;

use pgfence::issuer::{IssuerState, PgIssuer};
use pgfence::{Error, Fence, Lease, RedisIssuer, Repository, Resource, TokenIssuer};
use sqlx::PgPool;

use crate::support::{TestDb, redis_url};

const SEC: Duration = Duration::from_secs(1);

/// Resources each test locks.
const RESOURCES: usize = 120;
/// The same, as PostgreSQL counts.
const ROWS: i64 = 120;

#[derive(Clone, sqlx::FromRow)]
struct IdleItem {
    id: String,
    payload: String,
}
pgfence::fenced_table!(IdleItem { table: "idle_item", key: id: String, columns: [payload] });

fn item(i: usize, payload: &str) -> IdleItem {
    IdleItem {
        id: format!("item-{i}"),
        payload: payload.to_owned(),
    }
}

/// A database with `idle_item` guarded, one row per resource.
async fn items() -> (TestDb, Repository<IdleItem>) {
    let db = TestDb::new().await;
    db.exec(&format!(
        "CREATE TABLE idle_item (id text PRIMARY KEY, payload text NOT NULL); \
         INSERT INTO idle_item SELECT 'item-' || g, 'initial' FROM generate_series(0, {}) g;",
        RESOURCES - 1
    ))
    .await;
    pgfence::guard::guard(
        &db.pool,
        &pgfence::table::TableName::parse("idle_item").unwrap(),
    )
    .await
    .unwrap();
    let repo = Repository::<IdleItem>::new(db.pool.clone()).unwrap();
    (db, repo)
}

fn resources(tag: &str) -> Vec<Resource> {
    (0..RESOURCES)
        .map(|i| Resource::new(format!("{tag}:invoice:{i}")).unwrap())
        .collect()
}

/// A key prefix of this test alone, so that its keys can be counted on the shared Redis.
fn test_prefix(tag: &str) -> String {
    format!("{tag}-{:08x}", rand::random::<u32>())
}

/// Locks every resource three times (even ones: each lease checks its mark; odd ones: each
/// lease writes the resource's row), releasing each lease: every counter is at 3, every
/// resource idle. Returns the last lease of each.
async fn use_each_three_times(
    issuer: &dyn TokenIssuer,
    db: &TestDb,
    repo: &Repository<IdleItem>,
    names: &[Resource],
) -> Vec<Lease> {
    use futures_util::StreamExt;
    let fence = Fence::new(db.pool.clone());
    // 16 resources at a time: done well within the idle expiry.
    futures_util::stream::iter(names.iter().enumerate())
        .map(|(i, resource)| {
            let fence = &fence;
            async move {
                let mut lease = None;
                for round in 0..3 {
                    let l = issuer.acquire(resource, SEC).await.unwrap().unwrap();
                    if i % 2 == 0 {
                        fence.check(&db.pool, resource, &l).await.unwrap();
                    } else {
                        repo.update(&db.pool, &l, &item(i, &format!("round {round}")))
                            .await
                            .unwrap();
                    }
                    issuer.release(&l).await.unwrap();
                    lease = Some(l);
                }
                lease.unwrap()
            }
        })
        .buffered(16)
        .collect()
        .await
}

/// The keys of `prefix` on Redis, counted with `SCAN`.
async fn redis_keys(prefix: &str) -> usize {
    let client = redis::Client::open(redis_url().await).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut cursor = 0u64;
    let mut n = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .unwrap();
        n += keys.len();
        if next == 0 {
            return n;
        }
        cursor = next;
    }
}

/// The next lease of each resource after its state expired: an even resource's (marks) is
/// accepted at once, above its mark; an odd one's (rows only) is accepted at once when
/// `rows_known` (the issuer kept a floor), else refused as stale first, healed with one
/// `recover_from`, and accepted on the lease after. The stale write changes nothing.
async fn next_leases_are_accepted(
    issuer: &dyn TokenIssuer,
    db: &TestDb,
    repo: &Repository<IdleItem>,
    names: &[Resource],
    before: &[Lease],
    rows_known: bool,
) -> usize {
    let fence = Fence::new(db.pool.clone());
    let mut healed = 0;
    for (i, resource) in names.iter().enumerate() {
        let old = before[i].token().get();
        let lease = issuer.acquire(resource, SEC).await.unwrap().unwrap();
        if i % 2 == 0 {
            assert!(
                lease.token().get() > old,
                "{resource}: token {} after {old}",
                lease.token()
            );
            fence.check(&db.pool, resource, &lease).await.unwrap();
        } else if rows_known {
            assert!(lease.token().get() > old, "{resource}");
            repo.update(&db.pool, &lease, &item(i, "after idle"))
                .await
                .unwrap();
        } else {
            let err = repo
                .update(&db.pool, &lease, &item(i, "lower token"))
                .await
                .unwrap_err();
            assert!(
                matches!(err, Error::StaleToken { current, .. } if current == old),
                "{resource}: {err:?}"
            );
            let payload: String = sqlx::query_scalar("SELECT payload FROM idle_item WHERE id = $1")
                .bind(format!("item-{i}"))
                .fetch_one(&db.pool)
                .await
                .unwrap();
            assert_eq!(payload, "round 2", "the refused write changed nothing");
            assert!(issuer.recover_from(&err).await.unwrap());
            issuer.release(&lease).await.unwrap();
            let lease = issuer.acquire(resource, SEC).await.unwrap().unwrap();
            assert_eq!(
                lease.token().get(),
                old + 1,
                "{resource}: healed above the row"
            );
            repo.update(&db.pool, &lease, &item(i, "after idle"))
                .await
                .unwrap();
            issuer.release(&lease).await.unwrap();
            healed += 1;
            continue;
        }
        issuer.release(&lease).await.unwrap();
    }
    let written: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idle_item WHERE payload = 'after idle'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(written, ROWS / 2);
    healed
}

/// Polls `issuer.state()` until `done` holds (at most `within`).
async fn state_until(
    issuer: &dyn TokenIssuer,
    within: Duration,
    done: impl Fn(&IssuerState) -> bool,
) -> IssuerState {
    let until = tokio::time::Instant::now() + within;
    loop {
        let state = issuer.state().await.unwrap().expect("the issuer counts");
        if done(&state) || tokio::time::Instant::now() > until {
            return state;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Redis: every counter of 120 idle resources expires (0 keys of the prefix left); the next
/// lease of a resource with marks is re-created above them by the floor source (logged and
/// counted), and one with rows only is refused once and healed by `recover_from`.
#[tokio::test]
async fn redis_idle_counters_expire_and_next_leases_write_above_marks_and_rows() {
    let (db, repo) = items().await;
    let prefix = test_prefix("idle");
    let issuer = RedisIssuer::connect(&redis_url().await)
        .await
        .unwrap()
        .with_key_prefix(&prefix)
        .unwrap()
        .with_floor_source(db.pool.clone())
        .with_idle_expiry(3 * SEC)
        .unwrap();
    assert_eq!(TokenIssuer::idle_expiry(&issuer), Some(3 * SEC));
    let names = resources("redis-idle");
    let before = use_each_three_times(&issuer, &db, &repo, &names).await;

    let state = issuer.state().await.unwrap().unwrap();
    assert_eq!(state.counters, RESOURCES as u64, "{state:?}");
    assert_eq!(state.expiring, Some(RESOURCES as u64), "{state:?}");
    assert_eq!(state.idle, RESOURCES as u64, "all released: {state:?}");
    assert!(redis_keys(&prefix).await >= RESOURCES);

    // The last lease's TTL (1 s) plus the idle expiry (3 s), and Redis's expiry cycle.
    let gone = state_until(&issuer, 15 * SEC, |s| s.counters == 0).await;
    assert_eq!(gone.counters, 0, "{gone:?}");
    assert_eq!(redis_keys(&prefix).await, 0, "no key of the prefix is left");

    let healed = next_leases_are_accepted(&issuer, &db, &repo, &names, &before, false).await;
    assert_eq!(healed, RESOURCES / 2);
}

/// A lease that keeps extending past the idle expiry keeps its counter: the counter's
/// expiry is pushed past each new TTL, so the next lease continues from it.
#[tokio::test]
async fn redis_counter_outlives_a_lease_that_keeps_extending() {
    let prefix = test_prefix("idle-extend");
    let issuer = RedisIssuer::connect(&redis_url().await)
        .await
        .unwrap()
        .with_key_prefix(&prefix)
        .unwrap()
        .with_idle_expiry(SEC)
        .unwrap();
    let resource = Resource::new("extend:me").unwrap();
    let mut lease = issuer.acquire(&resource, SEC).await.unwrap().unwrap();
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(
            issuer.extend(&mut lease, SEC).await.unwrap(),
            pgfence::issuer::LeaseState::Held
        );
    }
    // 3.2 s after the acquire, well past its TTL + idle expiry (2 s).
    assert_eq!(issuer.status(&resource).await.unwrap().counter, 1);
    issuer.release(&lease).await.unwrap();
    let next = issuer.acquire(&resource, SEC).await.unwrap().unwrap();
    assert_eq!(next.token().get(), 2, "the counter was kept");
}

/// Idle expiry outside its bounds is refused, changing nothing.
#[tokio::test]
async fn idle_expiry_out_of_bounds_is_refused() {
    let issuer = RedisIssuer::connect(&redis_url().await).await.unwrap();
    for bad in [Duration::ZERO, Duration::from_millis(999), Duration::MAX] {
        let err = issuer.clone().with_idle_expiry(bad).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Invalid(pgfence::error::InvalidInput::Duration(_))
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("idle expiry"), "{err}");
    }
    let db = TestDb::new().await;
    let pg = PgIssuer::new(db.pool.clone());
    assert!(pg.clone().with_idle_expiry(Duration::ZERO).is_err());
    assert!(pg.expire_idle(Duration::ZERO).await.is_err());
    let err = pgfence::issuer::connect_issuer_with(
        &redis_url().await,
        pgfence::issuer::IssuerOptions::new().idle_expiry(Duration::ZERO),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("idle expiry"), "{err}");
}

async fn pg_rows(pool: &PgPool, table: &str, prefix: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM pgfence.{table} WHERE prefix = $1"
    )))
    .bind(prefix)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// PostgreSQL: `expire_idle` deletes the 120 idle counters (0 rows left, at most one floor
/// per bucket), and since each counter's value is kept in its floor, the next lease of every
/// resource, rows-only ones included, is accepted at once.
#[tokio::test]
async fn pg_idle_counters_expire_into_floors_and_next_leases_are_accepted() {
    let (db, repo) = items().await;
    let prefix = test_prefix("pgidle");
    let issuer = PgIssuer::new(db.pool.clone())
        .with_key_prefix(&prefix)
        .unwrap();
    let names = resources("pg-idle");
    let before = use_each_three_times(&issuer, &db, &repo, &names).await;
    let state = issuer.state().await.unwrap().unwrap();
    assert_eq!(
        (state.counters, state.idle, state.floors),
        (RESOURCES as u64, RESOURCES as u64, 0),
        "{state:?}"
    );
    assert_eq!(pg_rows(&db.pool, "issuer_counter", &prefix).await, ROWS);

    // Not idle long enough: nothing goes.
    let kept = issuer.expire_idle(10 * SEC).await.unwrap();
    assert_eq!((kept.counters, kept.locks), (0, 0));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let done = issuer.expire_idle(SEC).await.unwrap();
    assert_eq!(done.counters, RESOURCES as u64);
    assert_eq!(pg_rows(&db.pool, "issuer_counter", &prefix).await, 0);
    assert_eq!(pg_rows(&db.pool, "issuer_lock", &prefix).await, 0);
    let floors = pg_rows(&db.pool, "issuer_floor", &prefix).await;
    assert!(floors > 0 && floors <= ROWS, "{floors}");
    let state = issuer.state().await.unwrap().unwrap();
    assert_eq!((state.counters, state.floors), (0, floors.cast_unsigned()));

    let healed = next_leases_are_accepted(&issuer, &db, &repo, &names, &before, true).await;
    assert_eq!(healed, 0, "the floors knew every row's token");
}

/// PostgreSQL: with `with_idle_expiry`, acquires expire idle state in the background, and a
/// lapsed lock row goes too.
#[tokio::test]
async fn pg_issuer_expires_idle_state_in_the_background() {
    let db = TestDb::new().await;
    let prefix = test_prefix("pgbg");
    let issuer = PgIssuer::new(db.pool.clone())
        .with_key_prefix(&prefix)
        .unwrap()
        .with_idle_expiry(SEC)
        .unwrap();
    let idle = Resource::new("bg:idle").unwrap();
    let lapsed = Resource::new("bg:lapsed").unwrap();
    let a = issuer.acquire(&idle, SEC).await.unwrap().unwrap();
    issuer.release(&a).await.unwrap();
    // Never released: its row lapses after 100 ms.
    let _b = issuer
        .acquire(&lapsed, Duration::from_millis(100))
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let busy = Resource::new("bg:busy").unwrap();
    let c = issuer.acquire(&busy, 5 * SEC).await.unwrap().unwrap();
    let state = state_until(&issuer, 5 * SEC, |s| s.counters == 1 && s.locks == 1).await;
    assert_eq!(
        (state.counters, state.locks, state.idle),
        (1, 1, 0),
        "{state:?}"
    );
    issuer.release(&c).await.unwrap();
    let again = issuer.acquire(&idle, SEC).await.unwrap().unwrap();
    assert_eq!(
        again.token().get(),
        2,
        "above the floor the first counter left"
    );
}

/// etcd keeps a lock key per held resource, under the lease's etcd lease, and nothing else
/// per resource (tokens are revisions): 40 resources whose leases lapse leave no key, and the
/// next lease of each has a larger token.
#[cfg(feature = "etcd")]
#[tokio::test]
async fn etcd_keeps_no_state_for_idle_resources() {
    let Some(etcd) = crate::etcd_issuer::needs_etcd("etcd_keeps_no_state_for_idle_resources")
    else {
        return;
    };
    let prefix = test_prefix("etcdidle");
    let issuer = pgfence::issuer::EtcdIssuer::connect(&crate::etcd_issuer::etcd_url(etcd).await)
        .await
        .unwrap()
        .with_key_prefix(&prefix)
        .unwrap();
    let names: Vec<Resource> = (0..40)
        .map(|i| Resource::new(format!("etcd-idle:{i}")).unwrap())
        .collect();
    let mut before = Vec::new();
    for resource in &names {
        // Left to lapse: never released.
        before.push(issuer.acquire(resource, SEC).await.unwrap().unwrap());
    }
    let held = issuer.state().await.unwrap().unwrap();
    assert_eq!((held.locks, held.counters), (40, 0), "{held:?}");
    let gone = state_until(&issuer, 20 * SEC, |s| s.locks == 0).await;
    assert_eq!((gone.locks, gone.counters), (0, 0), "{gone:?}");
    for (resource, old) in names.iter().zip(&before) {
        let lease = issuer.acquire(resource, SEC).await.unwrap().unwrap();
        assert!(lease.token() > old.token(), "{resource}");
        issuer.release(&lease).await.unwrap();
    }
}

/// ZooKeeper keeps one container node per resource while it has lock nodes; ZooKeeper deletes
/// it once it is empty (the test server checks every second; production: every minute,
/// `znode.container.checkIntervalMs`): 40 released resources leave no node under the
/// prefix's lock directory, and the next lease of each has a larger token.
#[cfg(feature = "zk")]
#[tokio::test]
async fn zk_keeps_no_state_for_idle_resources() {
    let Some(zk) = crate::zk_issuer::needs_zk("zk_keeps_no_state_for_idle_resources") else {
        return;
    };
    let url = crate::zk_issuer::zk_url(zk).await;
    let prefix = test_prefix("zkidle");
    let issuer = pgfence::issuer::ZkIssuer::connect(&url)
        .await
        .unwrap()
        .with_key_prefix(&prefix)
        .unwrap();
    let names: Vec<Resource> = (0..40)
        .map(|i| Resource::new(format!("zk-idle:{i}")).unwrap())
        .collect();
    let mut before = Vec::new();
    for resource in &names {
        let lease = issuer.acquire(resource, 5 * SEC).await.unwrap().unwrap();
        issuer.release(&lease).await.unwrap();
        before.push(lease);
    }
    let raw = zookeeper_client::Client::connect(url.trim_start_matches("zk://"))
        .await
        .unwrap();
    let root = format!("/{prefix}/lock");
    let (dirs, _) = raw.get_children(&root).await.unwrap();
    assert!(
        !dirs.is_empty(),
        "a directory per resource until ZooKeeper reaps it"
    );
    let gone = state_until(&issuer, 20 * SEC, |s| s.other == 0).await;
    assert_eq!((gone.other, gone.locks), (0, 0), "{gone:?}");
    let (dirs, _) = raw.get_children(&root).await.unwrap();
    assert!(dirs.is_empty(), "{dirs:?}");
    for (resource, old) in names.iter().zip(&before) {
        let lease = issuer.acquire(resource, SEC).await.unwrap().unwrap();
        assert!(lease.token() > old.token(), "{resource}");
        issuer.release(&lease).await.unwrap();
    }
}
