//! A service's own sqlx pool through Debian's PgBouncer (1.18, no prepared-statement
//! tracking): what the "Connection poolers" table of docs/operations.md says, measured.
//! Fenced repository writes from 8 client connections over 2 shared server connections:
//! session mode loses nothing; transaction mode fails with sqlx's defaults and with
//! `statement_cache_capacity(0)` (sqlx still names its statements), which is why
//! docs/operations.md sends service pools to session mode (or a PgBouncer that tracks
//! prepared statements).

use crate::support;

use std::time::Duration;

use pgfence::{Repository, Resource};
use pgfence_testkit::{PgBouncer, PoolMode, needs, optional};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use support::{TestDb, issuer, unique_resource};

#[derive(Debug, Clone, sqlx::FromRow)]
struct Counter {
    id: i32,
    n: i64,
}

pgfence::fenced_table!(Counter { table: "pooled_counter", key: id: i32, columns: [n] });

const TASKS: i32 = 8;
const WRITES: i64 = 20;

/// `(writes applied, errors, first error)` of TASKS tasks each writing its own row WRITES
/// times under its own lease, through `options`.
async fn fenced_writes(
    db: &TestDb,
    options: PgConnectOptions,
    offset: i32,
) -> (i64, usize, Option<String>) {
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(3))
        .connect_with(options)
        .await
        .expect("pool through PgBouncer");
    let issuer = issuer().await;
    let base = unique_resource("pooled");
    let mut tasks = Vec::new();
    for id in offset..offset + TASKS {
        let (pool, issuer, db_pool) = (pool.clone(), issuer.clone(), db.pool.clone());
        let resource = Resource::new(format!("{}:{id}", base.as_str())).unwrap();
        tasks.push(tokio::spawn(async move {
            let lease = issuer
                .acquire(&resource, Duration::from_secs(60))
                .await
                .unwrap()
                .unwrap();
            let repo = Repository::<Counter>::new(db_pool).unwrap();
            let (mut applied, mut errors, mut first) = (0, 0, None);
            for n in 1..=WRITES {
                // A transaction-mode pooler can leave a client waiting for a reply that went to
                // another client's statement: each write gets 2 s.
                let row = Counter { id, n };
                let write = repo.update(&pool, &lease, &row);
                match tokio::time::timeout(Duration::from_secs(2), write).await {
                    Ok(Ok(_)) => applied += 1,
                    Ok(Err(e)) => {
                        errors += 1;
                        first.get_or_insert(e.to_string());
                    }
                    Err(_) => {
                        errors += 1;
                        first.get_or_insert("no reply within 2 s".to_owned());
                        break;
                    }
                }
            }
            (applied, errors, first)
        }));
    }
    let mut total = (0, 0, None);
    for t in tasks {
        let (a, e, f) = match t.await {
            Ok(outcome) => outcome,
            // sqlx can panic decoding a reply that was another client's (a data row of another
            // statement's width, seen through a transaction-mode pooler). The task's counts
            // died with it: it counts as one error and no applied write (in session mode, the
            // error still fails the test).
            Err(e) if e.is_panic() => (0, 1, Some("sqlx panicked on a mixed-up reply".into())),
            Err(e) => panic!("write task: {e}"),
        };
        total.0 += a;
        total.1 += e;
        if total.2.is_none() {
            total.2 = f;
        }
    }
    // Not `close().await`: a connection stuck mid-protocol would hold it up.
    drop(pool);
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn service_pools_need_session_mode_on_pgbouncer_1_18() {
    let Some(pgbouncer) =
        needs::<optional::PgBouncer>("service_pools_need_session_mode_on_pgbouncer_1_18")
    else {
        return;
    };
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE pooled_counter (id int PRIMARY KEY, n bigint NOT NULL);
         INSERT INTO pooled_counter SELECT g, 0 FROM generate_series(0, 23) g;
         SELECT pgfence.guard('public', 'pooled_counter');",
    )
    .await;
    let target = (i64::from(TASKS)) * WRITES;
    let mut measured = Vec::new();
    for (round, (mode, cache_off)) in [
        (PoolMode::Session, false),
        (PoolMode::Transaction, false),
        (PoolMode::Transaction, true),
    ]
    .into_iter()
    .enumerate()
    {
        // Session mode holds a server connection per client connection: as many as the
        // client pool. Transaction mode shares 2 among the 8.
        let servers = if mode == PoolMode::Session { 8 } else { 2 };
        let bouncer = PgBouncer::start(pgbouncer, db.options.get_port(), mode, servers)
            .await
            .expect("PgBouncer");
        let mut options = db.options.clone().host("127.0.0.1").port(bouncer.port());
        if cache_off {
            options = options.statement_cache_capacity(0);
        }
        let offset = i32::try_from(round).unwrap() * TASKS;
        let (applied, errors, first) = fenced_writes(&db, options, offset).await;
        eprintln!(
            "{mode:?} mode{}: {applied}/{target} writes applied, {errors} errors (first: {first:?})",
            if cache_off {
                ", statement_cache_capacity(0)"
            } else {
                ""
            }
        );
        measured.push((mode, cache_off, applied, errors));
        drop(bouncer);
    }
    let (_, _, applied, errors) = measured[0];
    assert_eq!(
        (applied, errors),
        (target, 0),
        "session mode: every write applied"
    );
    for &(mode, cache_off, applied, errors) in &measured[1..] {
        assert!(
            errors > 0 && applied < target,
            "{mode:?} (cache off: {cache_off}): docs/operations.md says this fails on PgBouncer 1.18; it did not ({applied} applied, {errors} errors) — update docs/operations.md"
        );
    }
}
