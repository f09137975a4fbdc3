//! Production hardening of the `pgfence` binary: no panic from any input, secrets never
//! printed, counter recovery from Postgres, guard under a busy table, waits on a lock
//! without expiry, the command of `run` dying with it, fast and clear connection errors,
//! unmigrated databases, SQL case folding of table names.

use crate::support;

use std::collections::BTreeMap;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use sqlx::{Connection, PgConnection, PgPool};
use support::{TestDb, redis_url, unique_resource};

const BIN: &str = env!("CARGO_BIN_EXE_pgfence");

fn pgfence(db_url: &str, redis: &str, args: &[&str]) -> Output {
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

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The one error line of a failed run (asserting there is exactly one).
#[track_caller]
fn one_error(out: &Output) -> String {
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

async fn pg_snapshot(pool: &PgPool) -> Vec<String> {
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
async fn redis_snapshot(conn: &mut redis::aio::MultiplexedConnection) -> BTreeMap<String, String> {
    let keys: Vec<String> = conn.keys("*").await.unwrap();
    let mut out = BTreeMap::new();
    for key in keys {
        let value: Option<String> = conn.get(&key).await.unwrap_or(None);
        let pttl: i64 = conn.pttl(&key).await.unwrap();
        out.insert(key, format!("{value:?} expires={}", pttl >= 0));
    }
    out
}

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

/// URLs are shown without their passwords: userinfo, `password`, `sslpassword` and
/// token-like query parameters, in error lines, warnings and `--verbose` logs.
#[tokio::test]
async fn passwords_in_urls_are_never_printed() {
    let db = TestDb::new().await;
    let redis = redis_url().await;
    let secrets = ["s3cr3t-a", "s3cr3t-b", "s3cr3t-c", "s3cr3t-d", "s3cr3t-e"];
    let pg_urls = [
        "postgres://app@127.0.0.1:1/db?password=s3cr3t-a",
        "postgres://app:s3cr3t-b@127.0.0.1:1/db?sslpassword=s3cr3t-c&sslmode=disable",
        "postgres://127.0.0.1:1/db?user=app&api_token=s3cr3t-d&Secret=s3cr3t-e",
    ];
    for url in pg_urls {
        for args in [&["migrate"][..], &["--verbose", "tables"]] {
            let out = pgfence(url, &redis, args);
            // With --verbose, log lines (sqlx's warnings about the URL) come first.
            let err = text(&out.stderr);
            if args[0] != "--verbose" {
                one_error(&out);
            }
            assert!(
                err.contains("pgfence: cannot connect to PostgreSQL at"),
                "{err}"
            );
            for s in secrets {
                assert!(!err.contains(s), "{s} printed: {err}");
            }
            assert!(err.contains("***"), "{err}");
            assert!(
                err.trim_end()
                    .lines()
                    .last()
                    .unwrap()
                    .starts_with("pgfence: "),
                "{err}"
            );
        }
    }
    let out = pgfence(
        &db.url(),
        "redis://:s3cr3t-a@127.0.0.1:1/0?token=s3cr3t-b",
        &["lock", "status", "r"],
    );
    let err = one_error(&out);
    assert!(
        err.contains("redis://:***@127.0.0.1:1/0?token=***"),
        "{err}"
    );
    // A warning on a successful run (Postgres unreachable for counter recovery), verbose.
    let res = unique_resource("redact");
    let out = pgfence(
        "postgres://app:s3cr3t-c@127.0.0.1:1/db?password=s3cr3t-d",
        &redis,
        &["--verbose", "lock", "acquire", res.as_str(), "--ttl", "1s"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(all.contains("warning"), "{all}");
    for s in secrets {
        assert!(!all.contains(s), "{s} printed: {all}");
    }
}

/// With `DATABASE_URL` set, `lock acquire` and `run` recover a lost Redis counter from
/// Postgres's high-water mark by themselves.
#[tokio::test]
async fn lost_counter_is_recovered_from_postgres() {
    let db = TestDb::new().await;
    let redis = redis_url().await;
    let mut rconn = redis::Client::open(redis.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let res = unique_resource("recover");
    let r = res.as_str();
    sqlx::query("SELECT pgfence.check($1, 50)")
        .bind(r)
        .execute(&db.pool)
        .await
        .unwrap();
    let _: () = rconn
        .set(pgfence::issuer::redis::counter_key(&res), "3")
        .await
        .unwrap();
    let _: () = rconn
        .del(pgfence::issuer::redis::counter_key(&res))
        .await
        .unwrap();
    let out = pgfence(
        &db.url(),
        &redis,
        &["lock", "acquire", r, "--ttl", "5s", "--json"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["token"].as_i64(), Some(51), "{json}");
    let release = pgfence(
        &db.url(),
        &redis,
        &[
            "lock",
            "release",
            r,
            "--owner",
            json["owner"].as_str().unwrap(),
            "--token",
            "51",
        ],
    );
    assert!(release.status.success(), "{}", text(&release.stderr));

    // `run`, after another loss.
    sqlx::query("SELECT pgfence.check($1, 60)")
        .bind(r)
        .execute(&db.pool)
        .await
        .unwrap();
    let _: () = rconn
        .del(pgfence::issuer::redis::counter_key(&res))
        .await
        .unwrap();
    let out = pgfence(
        &db.url(),
        &redis,
        &[
            "run",
            "--resource",
            r,
            "--ttl",
            "5s",
            "--",
            "sh",
            "-c",
            "echo $PGFENCE_TOKEN",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "61");
}

/// An open transaction that wrote the table holds a lock that guard's DDL waits for: guard
/// gives up within `--lock-timeout` with a clear line, changes nothing, and succeeds once the
/// transaction ends. Same for unguard.
#[tokio::test]
async fn guard_and_unguard_give_up_on_a_busy_table() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE victim (id int PRIMARY KEY, v text NOT NULL); INSERT INTO victim VALUES (1, 'a');")
        .await;
    let redis = redis_url().await;
    let mut holder = PgConnection::connect_with(&db.options).await.unwrap();
    sqlx::raw_sql("BEGIN; UPDATE victim SET v = 'b'")
        .execute(&mut holder)
        .await
        .unwrap();
    let before = pg_snapshot(&db.pool).await;
    let started = Instant::now();
    let out = pgfence(
        &db.url(),
        &redis,
        &["guard", "victim", "--lock-timeout", "600ms"],
    );
    let took = started.elapsed();
    let err = one_error(&out);
    assert!(
        err.contains("is busy") && err.contains("raise --lock-timeout"),
        "{err}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(pg_snapshot(&db.pool).await, before, "nothing changed");
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    let out = pgfence(&db.url(), &redis, &["guard", "victim"]);
    assert!(out.status.success(), "{}", text(&out.stderr));

    sqlx::raw_sql("BEGIN; UPDATE victim SET v = 'c', fence = pgfence.lease_fence(1, 0)")
        .execute(&mut holder)
        .await
        .unwrap();
    let started = Instant::now();
    let out = pgfence(
        &db.url(),
        &redis,
        &["unguard", "victim", "--lock-timeout", "300ms"],
    );
    assert!(one_error(&out).contains("is busy"));
    assert!(started.elapsed() < Duration::from_secs(5));
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    let out = pgfence(&db.url(), &redis, &["unguard", "victim"]);
    assert!(
        text(&out.stdout).contains("unguarded"),
        "{}",
        text(&out.stderr)
    );
}

/// A lock key without an expiry: `--wait` backs off (a handful of attempts, not one per
/// millisecond), says the lock will not free itself, and the error says who holds it.
#[tokio::test]
async fn waiting_on_a_lock_without_expiry_backs_off_and_says_so() {
    let db = TestDb::new().await;
    let redis_server = pgfence_testkit::Server::redis().await.unwrap();
    let redis = redis_server.url();
    let mut rconn = redis::Client::open(redis.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let res = pgfence::Resource::new("stuck").unwrap();
    let _: () = rconn
        .set(pgfence::issuer::redis::lock_key(&res), "someone-else:5")
        .await
        .unwrap();
    let commands = |info: String| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix("total_commands_processed:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let before = commands(
        redis::cmd("INFO")
            .arg("stats")
            .query_async(&mut rconn)
            .await
            .unwrap(),
    );
    let started = Instant::now();
    let out = pgfence(
        &db.url(),
        &redis,
        &[
            "lock", "acquire", "stuck", "--ttl", "1s", "--wait", "1500ms",
        ],
    );
    let took = started.elapsed();
    let after = commands(
        redis::cmd("INFO")
            .arg("stats")
            .query_async(&mut rconn)
            .await
            .unwrap(),
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("has no expiry"), "warned: {err}");
    let last = err.trim_end().lines().last().unwrap();
    assert!(
        last.contains("held by someone-else (token 5), with no expiry"),
        "{last}"
    );
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(5),
        "{took:?}"
    );
    assert!(
        after - before < 80,
        "{} Redis commands in 1.5 s",
        after - before
    );

    // A lock with a TTL: the error says until when.
    let held = pgfence(
        &db.url(),
        &redis,
        &["lock", "acquire", "fine", "--ttl", "30s"],
    );
    assert!(held.status.success(), "{}", text(&held.stderr));
    let err = one_error(&pgfence(
        &db.url(),
        &redis,
        &["lock", "acquire", "fine", "--ttl", "1s"],
    ));
    assert!(
        err.contains("locked by another holder: held by ") && err.contains(", for another "),
        "{err}"
    );
    let ms: u64 = err
        .split(", for another ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap();
    assert!((25_000..=30_000).contains(&ms), "{err}");
}

/// SIGKILL of `pgfence run` (which cannot be handled) takes its command down too, through
/// the parent-death signal set by `setpriv`.
#[tokio::test]
async fn killing_run_kills_its_command() {
    if !std::path::Path::new("/usr/bin/setpriv").is_file() {
        eprintln!("skipped: /usr/bin/setpriv (util-linux) is not installed");
        return;
    }
    let db = TestDb::new().await;
    let redis = redis_url().await;
    let res = unique_resource("sigkill");
    let pidfile = std::env::temp_dir().join(format!("pgfence-kill-{}", rand::random::<u64>()));
    let script = format!("echo $$ > {}; exec sleep 30", pidfile.display());
    let mut child = Command::new(BIN)
        .args([
            "run",
            "--resource",
            res.as_str(),
            "--ttl",
            "5s",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .env("DATABASE_URL", db.url())
        .env("REDIS_URL", &redis)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut pid = None;
    for _ in 0..100 {
        if let Ok(s) = std::fs::read_to_string(&pidfile)
            && let Ok(p) = s.trim().parse::<u32>()
        {
            pid = Some(p);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid = pid.expect("the command started");
    let _ = std::fs::remove_file(&pidfile);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit(')').next().map(|r| r.trim_start().to_owned()))
            .is_some_and(|r| !r.starts_with('Z') && !r.starts_with('X'))
    };
    let mut gone = false;
    for _ in 0..60 {
        if !alive(pid) {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if !gone {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
    assert!(gone, "the command outlived pgfence run");
}

/// A closed port is reported at once, as refused; a missing database by its own message, once.
#[tokio::test]
async fn connection_errors_are_fast_and_say_why() {
    let redis = redis_url().await;
    let started = Instant::now();
    let err = one_error(&pgfence(
        "postgres://postgres@127.0.0.1:1/x",
        &redis,
        &["migrate"],
    ));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(err.to_lowercase().contains("refused"), "{err}");
    assert!(!err.contains("timed out"), "{err}");

    let admin = support::pg_url().await;
    let url = match admin.rsplit_once('/') {
        Some((base, _)) => format!("{base}/pgfence_no_such_database_xyz"),
        None => panic!("{admin}"),
    };
    let err = one_error(&pgfence(&url, &redis, &["tables"]));
    assert_eq!(err.matches("does not exist").count(), 1, "{err}");
    assert!(!err.contains("at line"), "{err}");
}

/// Commands on a database without pgfence's schema say to migrate.
#[tokio::test]
async fn unmigrated_database_suggests_migrate() {
    let db = TestDb::empty().await;
    db.exec("CREATE TABLE t (id int)").await;
    let redis = redis_url().await;
    for args in [
        &["guard", "t"][..],
        &["unguard", "t"],
        &["tables"],
        &["audit"],
        &["audit", "prune", "--older-than", "1d"],
        &["reseed", "r"],
    ] {
        let err = one_error(&pgfence(&db.url(), &redis, args));
        assert!(err.contains("run `pgfence migrate`"), "{args:?}: {err}");
    }
    let guarded: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_trigger WHERE NOT tgisinternal")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(guarded, 0);
}

/// `guard MixedCase` guards `mixedcase`, as SQL would; `guard '"MixedCase"'` the quoted one.
#[tokio::test]
async fn unquoted_table_names_fold_to_lower_case() {
    let db = TestDb::new().await;
    db.exec(r#"CREATE TABLE mixedcase (id int); CREATE TABLE "MixedCase" (id int);"#)
        .await;
    let redis = redis_url().await;
    let out = pgfence(&db.url(), &redis, &["guard", "MixedCase"]);
    assert!(
        text(&out.stdout).contains(r#"guarded "public"."mixedcase""#),
        "{}",
        text(&out.stderr)
    );
    let tables = text(&pgfence(&db.url(), &redis, &["tables"]).stdout);
    let names: Vec<&str> = tables
        .lines()
        .map(|l| l.split('\t').next().unwrap_or(l).trim())
        .collect();
    assert_eq!(names, [r#""public"."mixedcase""#], "{tables}");
    let out = pgfence(&db.url(), &redis, &["guard", "\"MixedCase\""]);
    assert!(
        text(&out.stdout).contains(r#"guarded "public"."MixedCase""#),
        "{}",
        text(&out.stderr)
    );
    let out = pgfence(&db.url(), &redis, &["unguard", "PUBLIC.MIXEDCASE"]);
    assert!(text(&out.stdout).contains(r#"unguarded "public"."mixedcase""#));
}

/// `pgfence grant ROLE` gives an application role what it needs and says what it granted;
/// the schema's owner is refused.
#[tokio::test]
async fn grant_gives_an_application_role_its_privileges() {
    let db = TestDb::new().await;
    let redis = redis_url().await;
    let role = format!("pgfence_app_{}", rand::random::<u32>());
    db.exec(&format!("CREATE ROLE {role}")).await;
    let out = pgfence(&db.url(), &redis, &["grant", &role.to_uppercase()]);
    let stdout = text(&out.stdout);
    let dropped = format!("DROP OWNED BY {role}; DROP ROLE {role}");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        stdout.contains(&format!("granted \"{role}\""))
            && stdout.contains("GRANT USAGE ON SCHEMA pgfence"),
        "{stdout}"
    );
    let can: (bool, bool) = sqlx::query_as(
        "SELECT has_schema_privilege($1, 'pgfence', 'USAGE'),
                has_function_privilege($1, 'pgfence.check(text, bigint, integer)', 'EXECUTE')",
    )
    .bind(&role)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    db.exec(&dropped).await;
    assert_eq!(can, (true, true));
    let owner: String = sqlx::query_scalar(
        "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'pgfence'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let err = one_error(&pgfence(
        &db.url(),
        &redis,
        &["grant", &format!("\"{owner}\"")],
    ));
    assert!(err.contains("owns the pgfence schema"), "{err}");
    let err = one_error(&pgfence(&db.url(), &redis, &["grant", "no_such_role_xyz"]));
    assert!(err.contains("does not exist"), "{err}");
}
