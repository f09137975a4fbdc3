//! The PostgreSQL issuer (`PgIssuer`) against real PostgreSQL: the lease semantics of the other
//! issuers (the shared suite in `issuer_suite`), its table layout, fencing domains and key
//! prefixes, hostile names, the token limit, least privilege, a restart and killed backends.
//!
//! The suite's tests share one migrated database per test binary on the tests' PostgreSQL
//! (`DATABASE_URL`, else a throwaway server); tests that look at the tables use databases of
//! their own.

use crate::issuer_suite;
use crate::support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use issuer_suite::Profile;
use pgfence::{
    Error, Fence, FenceToken, Resource, connect_issuer,
    issuer::{
        IssuerKind, IssuerOptions, LeaseState, PgIssuer, ReleaseOutcome, connect_issuer_with,
    },
};
use pgfence_testkit::Server;
use sqlx::postgres::PgPoolOptions;
use support::{TestDb, unique_resource};
use tokio::sync::OnceCell;
use tokio::time::Instant;

const SEC: Duration = Duration::from_secs(1);

/// Expiry is by the database clock, to the millisecond; a refused owner is told the holder's
/// remaining TTL.
const PG: Profile = Profile {
    name: "pg",
    label: "PostgreSQL",
    ttl_resolution: Duration::ZERO,
    expiry_slack: Duration::from_secs(2),
    reports_retry_in: true,
    counter_is_last_token: true,
};

/// Nothing to skip: PostgreSQL is what every test of this crate needs.
fn skip(_test: &str) -> Option<()> {
    Some(())
}

/// The URL of the migrated database the suite's tests share (one per test binary; on a
/// throwaway server it goes with the server).
async fn shared_db_url() -> String {
    static DB: OnceCell<String> = OnceCell::const_new();
    DB.get_or_init(|| async {
        let db = TestDb::new().await;
        let url = db.url();
        // Kept for the binary's life: the tests share it (each test has its own runtime, so
        // each connects its own pool).
        std::mem::forget(db);
        url
    })
    .await
    .clone()
}

/// An issuer on the shared database (a pool of its own: each test has its own runtime).
async fn issuer() -> PgIssuer {
    PgIssuer::connect(&shared_db_url().await)
        .await
        .expect("connect the PostgreSQL issuer")
}

// The suite's shared tests, as for the other issuers:
// concurrent_acquisitions_are_exclusive_and_strictly_increasing,
// expired_lease_cannot_release_or_extend_the_next_holders_lock,
// owner_extend_keeps_the_lock_past_its_ttl,
// retried_acquire_by_the_same_owner_returns_the_same_token,
// wait_acquire_gets_the_lock_when_it_frees_and_gives_up_on_time,
// paused_holder_is_fenced_by_postgres.
/// The suite's issuer: [`issuer`] (nothing optional to start).
async fn suite_issuer((): ()) -> PgIssuer {
    issuer().await
}

issuer_suite::lease_tests!(PG, skip, suite_issuer);

#[tokio::test]
async fn bad_ttls_owners_and_urls_are_refused_before_touching_postgres() {
    issuer_suite::bad_ttls_and_owners_are_refused(&PG, issuer().await).await;
    let issuer = issuer().await;
    let resource = unique_resource("pg-bad-owner");
    for owner in ["a\0b".to_owned(), "x".repeat(257)] {
        assert!(matches!(
            issuer.acquire_as(&resource, &owner, SEC).await,
            Err(Error::Invalid(pgfence::error::InvalidInput::Owner(_)))
        ));
    }
    for url in ["redis://127.0.0.1:6379", "postgres:/nohost", "mysql://h/db"] {
        assert!(
            matches!(
                PgIssuer::connect(url).await,
                Err(Error::Invalid(pgfence::error::InvalidInput::IssuerUrl(_)))
            ),
            "{url}"
        );
    }
    // A URL that does not parse is refused without echoing it (it may hold a password).
    let err = connect_issuer("postgres://user:s3cret@127.0.0.1:notaport/db")
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Invalid(pgfence::error::InvalidInput::IssuerUrl(_))
        ),
        "{err:?}"
    );
    assert!(!err.to_string().contains("s3cret"), "{err}");
}

/// The lease semantics of the other issuers, through `Arc<dyn TokenIssuer>`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_through_the_trait() {
    let issuer = connect_issuer(&shared_db_url().await).await.unwrap();
    assert_eq!(issuer.kind(), IssuerKind::Postgres);
    assert_eq!(issuer.kind().name(), "postgres");
    assert!(issuer.kind().is_built());
    assert!(!issuer.kind().can_reseed());
    // Expiry by the database clock, to the millisecond: sub-second TTLs work.
    issuer_suite::lease_semantics(issuer, Duration::from_millis(300), SEC).await;
}

/// The counter commits with the fences: raise_floor, recover_from and reseed change nothing.
#[tokio::test]
async fn pg_floor_and_recovery_are_no_ops() {
    let db = TestDb::new().await;
    let issuer = connect_issuer(&db.url()).await.unwrap();
    let resource = unique_resource("pg-floor");
    let first = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
    issuer.release(&first).await.unwrap();
    let counter = issuer.status(&resource).await.unwrap().counter;
    assert_eq!(counter, first.token().get());
    let after = issuer_suite::floor_and_recovery_are_no_ops(&*issuer, &resource, counter).await;
    assert_eq!(after, counter, "nothing raised");
    assert_eq!(
        issuer.reseed(&db.pool, &resource).await.unwrap(),
        counter + 1,
        "the suite's own lease"
    );
}

/// Two prefixes on one database: two locks and two counters for one resource.
#[tokio::test]
async fn pg_key_prefixes_separate_locks_and_counters() {
    let db = TestDb::new().await;
    let a = PgIssuer::new(db.pool.clone())
        .with_key_prefix("app-a")
        .unwrap();
    assert_eq!(a.key_prefix(), "app-a");
    let resource = unique_resource("pg-prefix");
    issuer_suite::key_prefixes_separate_locks(&a, &db.url(), &resource).await;
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT prefix, value FROM pgfence.issuer_counter ORDER BY prefix")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        [("app-a".into(), 1), ("app-b".into(), 1)],
        "own counters"
    );
    assert!(matches!(
        PgIssuer::new(db.pool.clone()).with_key_prefix("a b"),
        Err(Error::Invalid(pgfence::error::InvalidInput::KeyPrefix(_)))
    ));
    assert!(matches!(
        connect_issuer_with(&db.url(), IssuerOptions::new().key_prefix("")).await,
        Err(Error::Invalid(pgfence::error::InvalidInput::KeyPrefix(_)))
    ));
}

/// The rows are what the docs say; a lock deleted by hand is lost to its holder; resources of
/// one fencing domain draw from one counter; hostile names are stored as they are.
#[tokio::test]
async fn layout_domains_hostile_names_and_a_deleted_lock() {
    let db = TestDb::new().await;
    let issuer = PgIssuer::new(db.pool.clone());
    let one = Resource::new("{billing}account:1").unwrap();
    let two = Resource::new("{billing}account:2").unwrap();
    let a = issuer.acquire(&one, 5 * SEC).await.unwrap().unwrap();
    let b = issuer.acquire(&two, 5 * SEC).await.unwrap().unwrap();
    assert_eq!(
        b.token().get(),
        a.token().get() + 1,
        "one counter per domain"
    );
    let (owner, token, live): (String, i64, bool) = sqlx::query_as(
        "SELECT owner, token, expires_at > clock_timestamp() FROM pgfence.issuer_lock \
         WHERE prefix = 'pgfence' AND resource = $1",
    )
    .bind(two.as_str())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (owner.as_str(), token, live),
        (b.owner(), b.token().get(), true)
    );
    let counter: i64 = sqlx::query_scalar(
        "SELECT value FROM pgfence.issuer_counter WHERE prefix = 'pgfence' AND counter = 'billing'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(counter, b.token().get());
    assert_eq!(issuer.status(&one).await.unwrap().counter, counter);

    // An operator deletes A's lock and someone takes it: A is told so, and cannot free it.
    db.exec("DELETE FROM pgfence.issuer_lock WHERE resource = '{billing}account:1'")
        .await;
    issuer_suite::deleted_lock_is_lost_to_its_holder(&issuer, &one, a, &b).await;

    // Names that would break naive quoting: stored and matched exactly.
    for name in [r"it's", r"back\slash", r"a'b\'c;--", r"\\'", "ünïcødé:€"] {
        let resource = Resource::new(name).unwrap();
        let lease = issuer.acquire(&resource, 5 * SEC).await.unwrap().unwrap();
        let stored: String = sqlx::query_scalar(
            "SELECT resource FROM pgfence.issuer_lock WHERE resource = $1 AND owner = $2",
        )
        .bind(name)
        .bind(lease.owner())
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(stored, name);
        assert_eq!(
            issuer.status(&resource).await.unwrap().token,
            Some(lease.token().get())
        );
        assert!(issuer.acquire(&resource, SEC).await.unwrap().is_none());
        assert_eq!(
            issuer.release(&lease).await.unwrap(),
            ReleaseOutcome::Released
        );
    }
    let prefixed = PgIssuer::new(db.pool.clone())
        .with_key_prefix(r"o'k\x")
        .unwrap();
    let lease = prefixed
        .acquire(&Resource::new("p").unwrap(), SEC)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(lease.token().get(), 1);
    let prefixes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pgfence.issuer_lock WHERE prefix = E'o''k\\\\x' AND resource = 'p'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(prefixes, 1);
}

/// A new counter starts above the high-water mark PostgreSQL recorded (a resource that was
/// fenced with another issuer's tokens keeps working); an existing one is not moved.
#[tokio::test]
async fn a_new_counter_starts_above_the_recorded_high_water_mark() {
    let db = TestDb::new().await;
    let fence = Fence::new(db.pool.clone());
    let resource = unique_resource("pg-floor-mark");
    let mut tx = db.pool.begin().await.unwrap();
    fence
        .check(&mut *tx, &resource, FenceToken::new(41).unwrap())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let issuer = PgIssuer::new(db.pool.clone());
    let lease = issuer.acquire(&resource, SEC).await.unwrap().unwrap();
    assert_eq!(lease.token().get(), 42);
    // Its check passes where token 41's elders are fenced out.
    let mut tx = db.pool.begin().await.unwrap();
    fence.check(&mut *tx, &resource, &lease).await.unwrap();
    tx.commit().await.unwrap();
    // Domain: the highest mark of the domain.
    let d1 = Resource::new(format!("{{dom{}}}a", rand::random::<u32>())).unwrap();
    let d2 = Resource::new(format!("{{{}}}b", d1.domain().unwrap())).unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    fence
        .check(&mut *tx, &d1, FenceToken::new(7).unwrap())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let lease = issuer.acquire(&d2, SEC).await.unwrap().unwrap();
    assert_eq!(lease.token().get(), 8, "above the domain's mark");
}

/// An acquire whose token would pass the token limit is refused and changes nothing: the lock
/// stays free, the counter as it was.
#[tokio::test]
async fn a_refused_acquire_at_the_token_limit_changes_nothing() {
    let db = TestDb::new().await;
    let issuer = PgIssuer::new(db.pool.clone());
    let resource = unique_resource("pg-limit");
    let lease = issuer.acquire(&resource, SEC).await.unwrap().unwrap();
    issuer.release(&lease).await.unwrap();
    sqlx::query("UPDATE pgfence.issuer_counter SET value = $1")
        .bind(pgfence::token::MAX_TOKEN)
        .execute(&db.pool)
        .await
        .unwrap();
    let err = issuer.acquire(&resource, SEC).await.unwrap_err();
    assert!(
        matches!(err, Error::Invalid(pgfence::error::InvalidInput::Token(_))),
        "{err:?}"
    );
    assert!(err.to_string().contains("token limit"), "{err}");
    let status = issuer.status(&resource).await.unwrap();
    assert_eq!(status.owner, None, "the lock stays free");
    assert_eq!(
        status.counter,
        pgfence::token::MAX_TOKEN,
        "the counter is unchanged"
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM pgfence.issuer_lock")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, 0, "no lock row left behind");
}

/// An application role that `pgfence grant` prepared takes, extends and releases leases, and
/// cannot touch the tables: it cannot lower a counter, forge or steal a lock.
#[tokio::test]
async fn the_granted_application_role_leases_but_cannot_lower_or_steal() {
    let db = TestDb::new().await;
    let role = support::Role::create(&db, "pgfence_app", "").await;
    pgfence::admin::grant(&db.pool, &role.ident())
        .await
        .unwrap();
    let app = role.pool(&db).await;
    let issuer = PgIssuer::new(app.clone());
    let resource = unique_resource("pg-app");
    let mut lease = issuer.acquire(&resource, 5 * SEC).await.unwrap().unwrap();
    assert_eq!(
        issuer.extend(&mut lease, 5 * SEC).await.unwrap(),
        LeaseState::Held
    );
    assert!(issuer.status(&resource).await.unwrap().owner.is_some());
    for sql in [
        "UPDATE pgfence.issuer_counter SET value = 0",
        "DELETE FROM pgfence.issuer_lock",
        "UPDATE pgfence.issuer_lock SET owner = 'me'",
        "INSERT INTO pgfence.issuer_counter VALUES ('pgfence', 'x', 0)",
        "SELECT * FROM pgfence.issuer_lock",
    ] {
        let err = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&app)
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("permission denied"),
            "{sql}: {err}"
        );
    }
    // Another owner with the holder's token (it can read it from status) is not the holder.
    let forged = pgfence::Lease::resume(resource.clone(), "intruder", lease.token());
    assert_eq!(
        issuer.release(&forged).await.unwrap(),
        ReleaseOutcome::TakenByOther
    );
    assert_eq!(
        issuer.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    let next = issuer.acquire(&resource, SEC).await.unwrap().unwrap();
    assert_eq!(next.token().get(), lease.token().get() + 1);
    app.close().await;
}

/// A server of its own, restarted while 4 workers take and release leases and while their
/// backends are killed: tokens keep rising per resource, a lease held across the restart is
/// still held (the lock and counter are durable rows), and the workers' only errors are
/// retryable ones, each followed by a successful acquisition.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_and_locks_survive_a_restart_and_killed_backends() {
    let mut server = Server::postgres().await.expect("throwaway PostgreSQL");
    let admin = sqlx::PgPool::connect(&server.url()).await.unwrap();
    pgfence::admin::migrate(&admin).await.unwrap();
    admin.close().await;
    let issuer = PgIssuer::connect(&server.url()).await.unwrap();
    let long = unique_resource("pg-restart-held");
    let held = issuer.acquire(&long, 60 * SEC).await.unwrap().unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let grants = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..4 {
        let (issuer, stop, grants) = (issuer.clone(), stop.clone(), grants.clone());
        workers.push(tokio::spawn(async move {
            let resource = Resource::new(format!("pg-restart-{w}")).unwrap();
            let mut tokens = Vec::new();
            let mut errors = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match issuer.acquire_wait(&resource, SEC, 20 * SEC).await {
                    Ok(Some(lease)) => {
                        tokens.push(lease.token().get());
                        grants.fetch_add(1, Ordering::Relaxed);
                        // A release lost to a fault leaves the lock to expire: still safe.
                        if let Err(e) = issuer.release(&lease).await {
                            assert!(e.is_retryable(), "{e:?}");
                        }
                    }
                    Ok(None) => panic!("no lease within 20 s"),
                    Err(e) => {
                        assert!(e.is_retryable(), "only transient errors: {e:?}");
                        errors.push(e.to_string());
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
            (tokens, errors)
        }));
    }
    let wait_grants = |n: usize| {
        let grants = grants.clone();
        async move {
            let deadline = Instant::now() + 30 * SEC;
            while grants.load(Ordering::Relaxed) < n {
                assert!(Instant::now() < deadline, "stuck below {n} grants");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    wait_grants(200).await;
    let started_before = start_time(&server.url()).await;
    server.restart().await.expect("restart");
    assert_ne!(
        start_time(&server.url()).await,
        started_before,
        "a real restart"
    );
    let after_restart = grants.load(Ordering::Relaxed);
    wait_grants(after_restart + 200).await;
    // Kill every backend but our own, twice, while the workers run.
    let killer = sqlx::PgPool::connect(&server.url()).await.unwrap();
    let mut killed = 0;
    for _ in 0..2 {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
        )
        .fetch_one(&killer)
        .await
        .unwrap();
        killed += n;
        let now = grants.load(Ordering::Relaxed);
        wait_grants(now + 100).await;
    }
    assert!(killed > 0, "backends were killed");
    stop.store(true, Ordering::Relaxed);
    let mut errors = 0;
    for worker in workers {
        let (tokens, errs) = worker.await.unwrap();
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "strictly increasing per resource"
        );
        assert_eq!(tokens.iter().collect::<BTreeSet<_>>().len(), tokens.len());
        errors += errs.len();
    }
    // The lease taken before the restart still holds its lock.
    let status = issuer.status(&long).await.unwrap();
    assert_eq!(status.token, Some(held.token().get()));
    assert_eq!(
        issuer.release(&held).await.unwrap(),
        ReleaseOutcome::Released
    );
    eprintln!(
        "pg issuer under faults: {} grants, 1 restart, {killed} backends killed, {errors} transient errors seen by callers",
        grants.load(Ordering::Relaxed)
    );
    killer.close().await;
    issuer.pool().close().await;
    server.stop();
}

async fn start_time(url: &str) -> String {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let t: String = sqlx::query_scalar("SELECT pg_postmaster_start_time()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    t
}

/// Through Debian's PgBouncer in transaction mode, with 2 server connections shared by the
/// issuer's 8 client connections: the issuer works (the suite's exclusivity test and the lease
/// semantics), and leaves no advisory lock or setting on the server connections. The control
/// shows that the pooler really shares connections: sqlx's named prepared statements, from
/// three client connections, collide on them. Also in session mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_issuer_works_through_pgbouncer_in_transaction_and_session_mode() {
    use pgfence_testkit::{PgBouncer, PoolMode, needs, optional};
    let Some(pgbouncer) = needs::<optional::PgBouncer>(
        "the_issuer_works_through_pgbouncer_in_transaction_and_session_mode",
    ) else {
        return;
    };
    let server = Server::postgres().await.expect("throwaway PostgreSQL");
    let direct = sqlx::PgPool::connect(&server.url()).await.unwrap();
    pgfence::admin::migrate(&direct).await.unwrap();
    let bouncer = PgBouncer::start(pgbouncer, server.port(), PoolMode::Transaction, 2)
        .await
        .expect("start PgBouncer");
    let url = bouncer.url("postgres");

    // Control: named prepared statements do not survive a transaction-mode pooler.
    let prepared = PgPoolOptions::new()
        .max_connections(3)
        .connect(&url)
        .await
        .unwrap();
    let mut conns = Vec::new();
    for _ in 0..3 {
        conns.push(prepared.acquire().await.unwrap());
    }
    let mut collisions = 0;
    for conn in &mut conns {
        if let Err(e) = sqlx::query_scalar::<_, i32>("SELECT $1::int4")
            .bind(1)
            .fetch_one(&mut **conn)
            .await
        {
            assert!(e.to_string().contains("prepared statement"), "{e}");
            collisions += 1;
        }
    }
    assert!(collisions > 0, "the pooler shares server connections");
    drop(conns);
    prepared.close().await;

    let issuer = PgIssuer::connect(&url).await.unwrap();
    issuer_suite::concurrent_acquisitions_are_exclusive_and_strictly_increasing(
        &PG,
        issuer.clone(),
    )
    .await;
    let through_trait = connect_issuer(&url).await.unwrap();
    issuer_suite::lease_semantics(through_trait, Duration::from_millis(300), SEC).await;
    let leftovers: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'), \
                (SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%')",
    )
    .fetch_one(&direct)
    .await
    .unwrap();
    assert_eq!(leftovers, (0, 0), "no advisory lock, no open transaction");
    issuer.pool().close().await;
    drop(bouncer);

    let session = PgBouncer::start(pgbouncer, server.port(), PoolMode::Session, 16)
        .await
        .expect("start PgBouncer (session mode)");
    assert_eq!(session.mode(), PoolMode::Session);
    let issuer = PgIssuer::connect(&session.url("postgres")).await.unwrap();
    issuer_suite::concurrent_acquisitions_are_exclusive_and_strictly_increasing(
        &PG,
        issuer.clone(),
    )
    .await;
    issuer.pool().close().await;
    direct.close().await;
    drop(session);
    server.stop();
}

#[derive(Clone, sqlx::FromRow)]
struct Account {
    id: i32,
    balance: i64,
}
pgfence::fenced_table!(Account { table: "pg_issuer_account", key: id: i32, columns: [balance] });

/// Leases from the PostgreSQL issuer fence rows like any other issuer's: a stale write is
/// rejected and audited with the lease's resource and holder, and a token handed out twice
/// (the counter set back by hand, as a lost-commit failover could) is caught as a duplicate.
#[tokio::test]
async fn its_leases_fence_rows_audit_rejections_and_catch_duplicate_tokens() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE pg_issuer_account (id int PRIMARY KEY, balance bigint NOT NULL); \
         INSERT INTO pg_issuer_account VALUES (1, 0);",
    )
    .await;
    pgfence::guard::guard(
        &db.pool,
        &pgfence::table::TableName::parse("pg_issuer_account").unwrap(),
    )
    .await
    .unwrap();
    let repo = pgfence::Repository::<Account>::new(db.pool.clone()).unwrap();
    let issuer = PgIssuer::new(db.pool.clone());
    let resource = unique_resource("pg-account");
    let a = issuer.acquire(&resource, SEC).await.unwrap().unwrap();
    repo.update(&db.pool, &a, &Account { id: 1, balance: 10 })
        .await
        .unwrap();
    issuer.release(&a).await.unwrap();
    let b = issuer.acquire(&resource, SEC).await.unwrap().unwrap();
    repo.update(&db.pool, &b, &Account { id: 1, balance: 20 })
        .await
        .unwrap();
    let err = repo
        .update(&db.pool, &a, &Account { id: 1, balance: 99 })
        .await
        .unwrap_err();
    support::assert_stale(&err, a.token().get(), b.token().get());
    let (holder, resource_col): (Option<String>, Option<String>) =
        sqlx::query_as("SELECT holder, resource FROM pgfence.audit WHERE presented = $1")
            .bind(a.token().get())
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(holder.as_deref(), Some(a.owner()));
    assert_eq!(resource_col.as_deref(), Some(resource.as_str()));
    issuer.release(&b).await.unwrap();
    // The counter set back by hand: the next lease gets b's token again, with another owner.
    sqlx::query("UPDATE pgfence.issuer_counter SET value = value - 1")
        .execute(&db.pool)
        .await
        .unwrap();
    // An owner whose holder tag differs from b's (tags are 8-bit hashes: 1 in 256 collide).
    let b_tag = pgfence::Fencing::from(&b).tag();
    let owner = (0..)
        .map(|i| format!("c-{i}"))
        .find(|o| {
            pgfence::Fencing::new(b.token())
                .resource(resource.clone())
                .holder(o.clone())
                .tag()
                != b_tag
        })
        .unwrap();
    let c = issuer
        .acquire_as(&resource, &owner, SEC)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(c.token(), b.token());
    let err = repo
        .update(&db.pool, &c, &Account { id: 1, balance: 30 })
        .await
        .unwrap_err();
    assert!(err.is_duplicate(), "{err:?}");
    let balance: i64 = sqlx::query_scalar("SELECT balance FROM pg_issuer_account")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(balance, 20, "only b's write");
}

/// A PostgreSQL issuer nobody listens at: the error names host:port and says it refused
/// (not "pool timed out", not a time-out), never the password, stays retryable, and
/// comes at once for a refused connection (not after the pool's timeout).
#[tokio::test]
async fn a_dead_server_is_named_with_its_host_and_the_bound() {
    let started = Instant::now();
    let err = connect_issuer("postgres://app:s3cret@127.0.0.1:1/db")
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("PostgreSQL at 127.0.0.1:1 refused the connection"),
        "{text}"
    );
    assert!(!text.contains("did not answer"), "{text}");
    assert!(!text.contains("pool timed out"), "{text}");
    assert!(!text.contains("s3cret"), "{text}");
    assert!(err.is_retryable(), "{err:?}");
    assert!(started.elapsed() < 4 * SEC, "{:?}", started.elapsed());
    let err = PgIssuer::connect("postgres://app:s3cret@127.0.0.1:notaport/db")
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains(
            "the PostgreSQL URL \"postgres://app:***@127.0.0.1:notaport/db\" did not parse"
        ),
        "{err}"
    );
}
