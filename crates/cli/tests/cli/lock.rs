//! `pgfence lock acquire|status|release`: the lock commands, waiting on a lock without expiry
//! (one clear line, a backoff), and a lost Redis counter recovered from Postgres.

use crate::common::exact_env::{ok, one_line_error, output};
use crate::common::urls::{one_error, pgfence};
use crate::common::{Cli, text};
use crate::support;

use std::time::{Duration, Instant};

use redis::AsyncCommands;
use support::{TestDb, redis_url, unique_resource};

#[tokio::test]
async fn lock_acquire_status_release() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let res = unique_resource("cli-lock");
    let r = res.as_str();
    let acquired: serde_json::Value =
        serde_json::from_str(&cli.ok(&["lock", "acquire", r, "--ttl", "30s", "--json"])).unwrap();
    let token = acquired["token"].as_i64().unwrap();
    let owner = acquired["owner"].as_str().unwrap().to_owned();
    assert_eq!(owner.len(), 32);

    let status: serde_json::Value =
        serde_json::from_str(&cli.ok(&["lock", "status", r, "--json"])).unwrap();
    assert_eq!(
        (status["token"].as_i64(), status["owner"].as_str()),
        (Some(token), Some(owner.as_str()))
    );
    assert!(
        cli.fails(&["lock", "acquire", r, "--ttl", "1s"])
            .contains("locked by another holder")
    );

    // A wrong owner cannot release it.
    let wrong = cli.run(&[
        "lock",
        "release",
        r,
        "--owner",
        "deadbeef",
        "--token",
        &token.to_string(),
    ]);
    assert_eq!(wrong.status.code(), Some(2));
    let released = cli.ok(&[
        "lock",
        "release",
        r,
        "--owner",
        &owner,
        "--token",
        &token.to_string(),
        "--json",
    ]);
    assert!(released.contains("\"released\""), "{released}");
    let again = cli.run(&[
        "lock",
        "release",
        r,
        "--owner",
        &owner,
        "--token",
        &token.to_string(),
    ]);
    assert_eq!(again.status.code(), Some(2));
    assert!(cli.ok(&["lock", "status", r]).contains("free; counter=1"));
}

/// A lock key set without a TTL by another owner: waiting for it fails with one line that
/// says it has no expiry; no warning line before it, for `lock acquire` and `run`, with or
/// without a usable PostgreSQL for counter recovery.
#[tokio::test]
async fn waiting_on_a_lock_without_expiry_fails_in_one_line() {
    let redis = redis_url().await;
    let mut rconn = redis::Client::open(redis.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let res = unique_resource("gaps-stuck");
    let r = res.as_str();
    let _: () = rconn
        .set(pgfence::issuer::redis::lock_key(&res), "someone-else:5")
        .await
        .unwrap();
    let acquire = ["lock", "acquire", r, "--ttl", "1s", "--wait", "300ms"];
    let run = [
        "run",
        "--resource",
        r,
        "--ttl",
        "1s",
        "--wait",
        "300ms",
        "--",
        "true",
    ];
    for args in [&acquire[..], &run[..]] {
        let err = one_line_error(&output(&[("REDIS_URL", &redis)], args));
        assert!(
            err.contains("held by someone-else (token 5), with no expiry")
                && err.contains("will not free itself"),
            "{err}"
        );
        // A database that cannot give the floor: its warning ends the error's line.
        let err = one_line_error(&output(
            &[
                ("REDIS_URL", &redis),
                ("DATABASE_URL", "postgres://postgres@127.0.0.1:1/none"),
            ],
            args,
        ));
        assert!(err.contains("with no expiry"), "{err}");
        assert!(
            err.contains("; warning: a lost Redis counter cannot be recovered from PostgreSQL"),
            "{err}"
        );
    }
    let _: () = rconn
        .del(pgfence::issuer::redis::lock_key(&res))
        .await
        .unwrap();

    // On success, the held-back warning is still said, after the output.
    let out = output(
        &[
            ("REDIS_URL", &redis),
            ("DATABASE_URL", "postgres://postgres@127.0.0.1:1/none"),
        ],
        &["lock", "acquire", r, "--ttl", "1s"],
    );
    assert!(ok(&out).contains("acquired"));
    let err = text(&out.stderr);
    assert_eq!(
        err.matches("pgfence: warning: a lost Redis counter cannot be recovered")
            .count(),
        1,
        "{err}"
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
