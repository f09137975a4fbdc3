//! `pgfence` against a database URL and a Redis URL, its one error line, and snapshots of
//! both servers (to show a failure changed nothing).

use std::collections::BTreeMap;
use std::process::{Command, Output, Stdio};

use redis::AsyncCommands;
use sqlx::PgPool;

use super::{BIN, text};

pub(crate) fn pgfence(db_url: &str, redis: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("DATABASE_URL", db_url)
        .env("REDIS_URL", redis)
        .env_remove("RUST_LOG")
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .output()
        .expect("run pgfence")
}

/// The one error line of a failed run (asserting there is exactly one).
#[track_caller]
pub(crate) fn one_error(out: &Output) -> String {
    assert!(!out.status.success(), "should fail: {}", text(&out.stdout));
    assert_ne!(
        out.status.code(),
        Some(101),
        "panicked: {}",
        text(&out.stderr)
    );
    let err = text(&out.stderr);
    assert!(err.starts_with("pgfence: "), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    err
}

pub(crate) async fn pg_snapshot(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        r"SELECT x FROM (
            SELECT format('col %s.%s.%s %s', n.nspname, c.relname, a.attname, format_type(a.atttypid, a.atttypmod)) AS x
              FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
              JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE a.attnum > 0 AND NOT a.attisdropped
               AND n.nspname NOT IN ('pg_catalog', 'information_schema')
               AND n.nspname NOT LIKE 'pg_toast%'
            UNION ALL SELECT format('trigger %s %s', tgrelid::regclass, tgname) FROM pg_trigger WHERE NOT tgisinternal
            UNION ALL SELECT 'victim ' || string_agg(v, ',' ORDER BY id) FROM victim
            UNION ALL SELECT 'audit ' || count(*) FROM pgfence.audit
            UNION ALL SELECT 'marks ' || coalesce(string_agg(t::text, ','), '') FROM pgfence.resource_fence t
        ) s ORDER BY x",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Every key with its value and whether it has an expiry.
pub(crate) async fn redis_snapshot(
    conn: &mut redis::aio::MultiplexedConnection,
) -> BTreeMap<String, String> {
    let keys: Vec<String> = conn.keys("*").await.unwrap();
    let mut out = BTreeMap::new();
    for key in keys {
        let value: Option<String> = conn.get(&key).await.unwrap_or(None);
        let pttl: i64 = conn.pttl(&key).await.unwrap();
        out.insert(key, format!("{value:?} expires={}", pttl >= 0));
    }
    out
}
