//! Every command closes the PostgreSQL connections it opened: the server's log of a throwaway
//! PostgreSQL, read after each command, has no line about a client that vanished ("could not
//! receive data from client: Connection reset by peer", "could not send data to client:
//! Broken pipe", "unexpected EOF on client connection"). Commands that fail take the paths
//! where a transaction is dropped, not committed: they are run several times (the reset is a
//! race between the server's answer to the queued ROLLBACK and the process's exit), and so is
//! a command stopped by Ctrl-C (`audit --follow`).

use crate::common::BIN;
use crate::support;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use pgfence_testkit::Server;
use sqlx::{Connection, PgConnection};

/// What PostgreSQL logs when a client went away without saying goodbye.
const VANISHED: &[&str] = &[
    "could not receive data from client",
    "could not send data to client",
    "connection to client lost",
    "unexpected EOF on client connection",
];

/// One run of the binary: its environment, its arguments, whether it succeeds.
type Run<'a> = (&'a [(&'a str, &'a str)], Vec<&'a str>, bool);

fn pgfence(env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .env_remove("PGFENCE_ISSUER_URL")
        .env_remove("PGFENCE_KEY_PREFIX")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    cmd.envs(env.iter().copied());
    cmd.output().expect("run pgfence")
}

/// The log lines about vanished clients since byte `from` of the log, and the log's length.
fn vanished_since(server: &Server, from: usize) -> (Vec<String>, usize) {
    let log = std::fs::read_to_string(server.log_path()).expect("read the server log");
    let lines = log
        .get(from..)
        .unwrap_or_default()
        .lines()
        .filter(|l| VANISHED.iter().any(|v| l.contains(v)))
        .map(str::to_owned)
        .collect();
    (lines, log.len())
}

#[tokio::test]
async fn no_command_leaves_a_reset_connection_in_the_server_log() {
    let server = Server::postgres().await.expect("a throwaway PostgreSQL");
    let url = server.url();
    let redis = support::redis_url().await;
    let mut admin = PgConnection::connect(&url).await.unwrap();
    // Every session's end is logged: the log is read, and the sessions are seen to end.
    for sql in [
        "ALTER SYSTEM SET log_disconnections = on",
        "SELECT pg_reload_conf()",
        "CREATE TABLE orders (id int PRIMARY KEY); CREATE TABLE lines (id int PRIMARY KEY);
         CREATE ROLE app LOGIN",
    ] {
        sqlx::raw_sql(sql).execute(&mut admin).await.unwrap();
    }
    admin.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;

    let redis_env = [
        ("DATABASE_URL", url.as_str()),
        ("REDIS_URL", redis.as_str()),
    ];
    let pg_issuer = [
        ("DATABASE_URL", url.as_str()),
        ("PGFENCE_ISSUER_URL", url.as_str()),
    ];
    let resource = support::unique_resource("cli-close");
    let r = resource.as_str();
    let job = format!(
        "{BIN} effect begin --work w --step s >/dev/null && {BIN} effect finish --work w --step s --outcome ok"
    );
    let dir = std::env::temp_dir().join(format!("pgfence-close-{}", rand::random::<u64>()));
    std::fs::create_dir(&dir).unwrap();
    let dir_arg = dir.to_str().unwrap();
    let commands: Vec<Run> = vec![
        // Before the schema exists: refused, the transaction dropped.
        (&redis_env, vec!["tables"], false),
        (&redis_env, vec!["migrate"], true),
        (&redis_env, vec!["migrate", "--status"], true),
        (&redis_env, vec!["migrate"], true),
        (&redis_env, vec!["guard", "orders", "lines"], true),
        (
            &redis_env,
            vec!["guard", "orders", "--emit-migration", dir_arg],
            true,
        ),
        (&redis_env, vec!["tables", "--json"], true),
        (&redis_env, vec!["unguard", "lines"], true),
        (&redis_env, vec!["grant", "app"], true),
        (&redis_env, vec!["audit"], true),
        (
            &redis_env,
            vec!["audit", "prune", "--older-than", "1d"],
            true,
        ),
        (&redis_env, vec!["lock", "acquire", r, "--ttl", "60s"], true),
        (&redis_env, vec!["lock", "status", r], true),
        (&redis_env, vec!["reseed", r], true),
        (&pg_issuer, vec!["lock", "status", "pg-issued"], true),
        (
            &pg_issuer,
            vec![
                "run",
                "--resource",
                "pg-issued",
                "--ttl",
                "10s",
                "--",
                "sh",
                "-c",
                &job,
            ],
            true,
        ),
        (
            &pg_issuer,
            vec![
                "effect",
                "status",
                "pg-issued",
                "--work",
                "w",
                "--step",
                "s",
            ],
            true,
        ),
        (&redis_env, vec!["doctor", "--no-redis"], true),
        (&redis_env, vec!["doctor", "--resource", r], true),
        (&redis_env, vec!["simulate"], true),
    ];
    // Failures: each drops a transaction on its way out.
    let failures: Vec<Run> = vec![
        (&redis_env, vec!["grant", "postgres"], false),
        (&redis_env, vec!["guard", "no_such_table"], false),
        (&redis_env, vec!["guard", "orders", "no_such_table"], false),
        (&redis_env, vec!["unguard", "no_such_table"], false),
        (
            &redis_env,
            vec!["lock", "acquire", r, "--ttl", "60s"],
            false,
        ),
    ];
    let mut from = vanished_since(&server, 0).1;
    let mut found = Vec::new();
    let rounds = std::iter::once(&commands).chain(std::iter::repeat_n(&failures, 8));
    for list in rounds {
        for (env, args, succeeds) in list {
            let out = pgfence(env, args);
            assert_eq!(
                out.status.success(),
                *succeeds,
                "pgfence {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            tokio::time::sleep(Duration::from_millis(30)).await;
            let (lines, len) = vanished_since(&server, from);
            from = len;
            found.extend(lines.into_iter().map(|l| format!("pgfence {args:?}: {l}")));
        }
    }
    // A lease of the PostgreSQL issuer taken and released.
    let out = pgfence(
        &pg_issuer,
        &["lock", "acquire", "pg-released", "--ttl", "60s", "--json"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lease: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (owner, token) = (lease["owner"].as_str().unwrap(), lease["token"].to_string());
    let release = [
        "lock",
        "release",
        "pg-released",
        "--owner",
        owner,
        "--token",
        &token,
    ];
    let out = pgfence(&pg_issuer, &release);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    tokio::time::sleep(Duration::from_millis(30)).await;
    let (lines, len) = vanished_since(&server, from);
    from = len;
    found.extend(
        lines
            .into_iter()
            .map(|l| format!("lock acquire/release: {l}")),
    );
    // Interrupted: Ctrl-C drops the command mid-way (`audit --follow` polls the audit trail);
    // its connections are still closed.
    for _ in 0..3 {
        let mut follow = Command::new(BIN);
        follow
            .args(["audit", "--follow"])
            .env_remove("PGFENCE_ISSUER_URL")
            .envs(redis_env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = follow.spawn().unwrap();
        tokio::time::sleep(Duration::from_millis(700)).await;
        pgfence_testkit::signal_pid(child.id(), "-INT").unwrap();
        let status = tokio::task::spawn_blocking(move || {
            let mut child = child;
            child.wait().unwrap()
        })
        .await
        .unwrap();
        assert_eq!(status.code(), Some(130), "audit --follow interrupted");
        tokio::time::sleep(Duration::from_millis(30)).await;
        let (lines, len) = vanished_since(&server, from);
        from = len;
        found.extend(
            lines
                .into_iter()
                .map(|l| format!("audit --follow, Ctrl-C: {l}")),
        );
    }
    // A line the server writes a little late is still seen.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (late, _) = vanished_since(&server, from);
    found.extend(
        late.into_iter()
            .map(|l| format!("after the last command: {l}")),
    );
    std::fs::remove_dir_all(&dir).unwrap();
    let log = std::fs::read_to_string(server.log_path()).unwrap();
    assert!(
        log.matches("disconnection: session time").count() >= 40,
        "the sessions' ends are in the log: {log}"
    );
    assert!(found.is_empty(), "clients vanished:\n{}", found.join("\n"));
}
