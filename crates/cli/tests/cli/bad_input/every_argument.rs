//! Garbage in every argument of every command: never a panic, and a failure changes nothing
//! in Postgres or Redis.

use crate::common::text;
use crate::common::urls::{pg_snapshot, pgfence, redis_snapshot};
use crate::support;

use std::time::{Duration, Instant};

use support::TestDb;

/// Every subcommand's every argument, fed garbage: huge, negative, empty, unicode, control
/// characters, URLs. Each run exits 0, or exits non-zero with one line on stderr (never a
/// panic's 101); a failed run changes nothing in Postgres or Redis.
#[tokio::test]
async fn garbage_in_every_argument_never_panics_and_failures_change_nothing() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE victim (id int PRIMARY KEY, v text NOT NULL); INSERT INTO victim VALUES (1, 'original');")
        .await;
    let redis_server = pgfence_testkit::Server::redis().await.unwrap();
    let redis = redis_server.url();
    let mut rconn = redis::Client::open(redis.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let db_url = db.url();
    let long = "x".repeat(5000);
    let values: Vec<&str> = vec![
        "",
        " ",
        "0",
        "-1",
        "99999999d",
        "18446744073709551615ms",
        "99999999999999999999",
        "-9223372036854775808",
        "1e9",
        "NaN",
        "ünïcødé 名前",
        "\u{202e}evil\t\r\n\u{1b}[31m",
        "'; DROP TABLE victim; --",
        "\"",
        "a.b.c",
        "--",
        &long,
        "postgres://u:pw-in-arg@127.0.0.1:1/x?password=pw2-in-arg",
    ];
    // `{}` is the argument under test; `{n}` a resource name unique to the case.
    let templates: Vec<Vec<&str>> = vec![
        vec!["migrate", "--status", "{}"],
        vec!["guard", "{}"],
        vec!["guard", "no_such_table", "--lock-timeout", "{}"],
        vec!["unguard", "{}"],
        vec!["unguard", "no_such_table", "--lock-timeout", "{}"],
        vec!["tables", "{}"],
        vec!["audit", "--since", "{}"],
        vec!["audit", "--limit", "{}"],
        vec!["audit", "--resource", "{}"],
        vec!["audit", "prune", "--older-than", "{}"],
        vec!["lock", "acquire", "{}", "--ttl", "1h"],
        vec!["lock", "acquire", "{n}", "--ttl", "{}"],
        vec!["lock", "acquire", "{n}", "--ttl", "1h", "--wait", "{}"],
        vec!["lock", "release", "{}", "--owner", "o", "--token", "1"],
        vec!["lock", "release", "{n}", "--owner", "{}", "--token", "1"],
        vec!["lock", "release", "{n}", "--owner", "o", "--token", "{}"],
        vec!["lock", "status", "{}"],
        vec!["run", "--resource", "{}", "--ttl", "1h", "--", "true"],
        vec!["run", "--resource", "{n}", "--ttl", "{}", "--", "true"],
        vec![
            "run",
            "--resource",
            "{n}",
            "--ttl",
            "1h",
            "--wait",
            "{}",
            "--",
            "true",
        ],
        vec!["run", "--resource", "{n}", "--ttl", "1h", "--", "{}"],
        vec!["reseed", "{}"],
        vec!["reseed", "{n}", "--floor", "{}"],
        vec!["simulate", "--ttl", "{}"],
        vec!["simulate", "--pause", "{}"],
        vec!["--database-url", "{}", "tables"],
        vec!["--database-url", "{}", "migrate"],
        vec!["--redis-url", "{}", "lock", "status", "r"],
        vec!["--redis-url", "{}", "lock", "acquire", "r", "--ttl", "1s"],
    ];
    let mut failures = Vec::new();
    let mut n = 0;
    for template in &templates {
        for value in &values {
            n += 1;
            let resource = format!("fuzz-{n}");
            let args: Vec<&str> = template
                .iter()
                .map(|a| match *a {
                    "{}" => *value,
                    "{n}" => resource.as_str(),
                    a => a,
                })
                .collect();
            let pg_before = pg_snapshot(&db.pool).await;
            let redis_before = redis_snapshot(&mut rconn).await;
            let started = Instant::now();
            let out = pgfence(&db_url, &redis, &args);
            let took = started.elapsed();
            let stderr = text(&out.stderr);
            let shown = format!(
                "{:?}",
                args.iter().map(|a| crate_short(a)).collect::<Vec<_>>()
            );
            if out.status.code() == Some(101) || stderr.contains("panicked") {
                failures.push(format!("{shown}: panicked: {stderr}"));
                continue;
            }
            if took > Duration::from_secs(15) {
                failures.push(format!("{shown}: took {took:?}"));
            }
            // (stdout may echo a resource name back; that is data, not a URL shown.)
            if stderr.contains("pw-in-arg") {
                failures.push(format!("{shown}: printed a password: {stderr}"));
            }
            if out.status.success() {
                continue;
            }
            // `lock release` reports a lock it no longer held with exit code 2, on stdout.
            let release_miss = args.get(1) == Some(&"release")
                && out.status.code() == Some(2)
                && stderr.is_empty();
            if !release_miss
                && (!stderr.starts_with("pgfence: ") || stderr.trim_end().lines().count() != 1)
            {
                failures.push(format!("{shown}: not one clear line: {stderr:?}"));
            }
            if pg_snapshot(&db.pool).await != pg_before {
                failures.push(format!("{shown}: failed but changed Postgres"));
            }
            if redis_snapshot(&mut rconn).await != redis_before {
                failures.push(format!("{shown}: failed but changed Redis"));
            }
        }
    }
    assert!(n > 400, "{n} cases");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn crate_short(s: &str) -> String {
    s.chars().take(40).collect()
}
