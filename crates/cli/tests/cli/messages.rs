//! Nothing fails silently (issue 30): what the user reads names what went wrong and what to
//! do — the host of a URL that did not parse or a server that did not answer (never the
//! password), the role a deploy-time command needs, the key prefix under which what was asked
//! for exists — and a closed stdout ends a command quietly.
//!
//! `PGFENCE_TEST_BIN` runs these against another build of the binary (to compare with an
//! older one).

use crate::common::urls::{one_error, pgfence};
use crate::support;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use support::{Role, TestDb, redis_url, unique_resource};

fn bin() -> String {
    std::env::var("PGFENCE_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_pgfence").to_owned())
}

/// Runs pgfence with only `env` (plus PATH) in its environment.
fn run(env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run pgfence")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Where a message must appear.
#[derive(Clone, Copy, Debug)]
enum Stream {
    Stdout,
    Stderr,
}

/// One user-facing message: the command, its exit code, and what the user must (and must
/// not) read.
struct Case<'a> {
    what: &'a str,
    env: Vec<(&'a str, String)>,
    args: Vec<String>,
    code: i32,
    stream: Stream,
    must: Vec<String>,
    must_not: Vec<&'a str>,
}

fn case<'a>(
    what: &'a str,
    env: &[(&'a str, &str)],
    args: &[&str],
    code: i32,
    stream: Stream,
    must: &[&str],
    must_not: &[&'a str],
) -> Case<'a> {
    Case {
        what,
        env: env.iter().map(|(k, v)| (*k, (*v).to_owned())).collect(),
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        code,
        stream,
        must: must.iter().map(|m| (*m).to_owned()).collect(),
        must_not: must_not.to_vec(),
    }
}

/// The messages of issue 30, each with the substrings the user must see. One database, one
/// application role, audit rows and a Redis counter of another key prefix, set up once.
#[tokio::test]
async fn messages_users_can_act_on() {
    let db = TestDb::new().await;
    let owner = db.options.get_username().to_owned();
    let url = db.url();
    let redis = redis_url().await;
    let app = Role::create(&db, "msg_app", "").await;
    let other = Role::create(&db, "msg_other", "").await;
    // A role `pgfence grant` never ran for.
    let stranger = Role::create(&db, "msg_stranger", "").await;
    assert!(
        run(&[("DATABASE_URL", &url)], &["grant", &app.name])
            .status
            .success()
    );
    let app_url = format!(
        "postgres://{}@{}:{}/{}",
        app.name,
        db.options.get_host(),
        db.options.get_port(),
        db.name
    );

    // A service with key prefix `nu4`: its audit rows and its Redis counter.
    let batch = unique_resource("recon");
    let stem = batch.as_str().to_owned();
    db.exec(&format!(
        "INSERT INTO pgfence.audit (resource, presented, current, operation)
         VALUES ('nu4{{{stem}:14', 3, 5, 'check')"
    ))
    .await;
    let mut redis_conn = redis::Client::open(redis.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let counter_key = format!("nu4:{{{stem}:1}}:fence");
    let _: () = redis::cmd("SET")
        .arg(&counter_key)
        .arg(14)
        .query_async(&mut redis_conn)
        .await
        .unwrap();
    // The service's mark on `STEM:2`, under its prefix's name.
    db.exec(&format!("SELECT pgfence.check('nu4{{{stem}:2', 40)"))
        .await;
    // A mark the application role's doctor can check (`--resource`), above its counter.
    let below = unique_resource("below");
    db.exec(&format!("SELECT pgfence.check('{}', 50)", below.as_str()))
        .await;

    let stranger_url = format!(
        "postgres://{}@{}:{}/{}",
        stranger.name,
        db.options.get_host(),
        db.options.get_port(),
        db.name
    );
    let as_stranger = ("DATABASE_URL", stranger_url.as_str());
    let grant_stranger = format!("run `pgfence grant \"{}\"`", stranger.name);
    let pg = ("DATABASE_URL", url.as_str());
    let as_app = ("DATABASE_URL", app_url.as_str());
    let no_redis = ("REDIS_URL", "redis://127.0.0.1:1");
    let with_redis = ("REDIS_URL", redis.as_str());
    let status_r = format!("{stem}:1");
    let audit_r = format!("{stem}:*");
    let grant_msg = format!("run it as role {owner:?}, the owner of schema pgfence");
    let not_as_app = format!("not as role {:?}", app.name);
    let prefix_hint = "pass --key-prefix nu4 (or set PGFENCE_KEY_PREFIX=nu4)";
    use Stream::{Stderr, Stdout};
    let cases = vec![
        case(
            "a Redis URL with a bad port: the host, what is wrong, no password",
            &[(
                "PGFENCE_ISSUER_URL",
                "redis://:hunter2@cache.internal:notaport",
            )],
            &["lock", "status", "r"],
            1,
            Stderr,
            &[
                "invalid issuer URL",
                "the Redis URL \"redis://:***@cache.internal:notaport\" did not parse",
                "the port \"notaport\" is not a number",
            ],
            &[
                "hunter2",
                "InvalidClientConfig",
                "cannot connect",
                "did not parse: Redis URL did not parse",
            ],
        ),
        case(
            "a Redis nobody listens at: host:port, refused (not a time-out), said once",
            &[("PGFENCE_ISSUER_URL", "redis://127.0.0.1:1")],
            &["lock", "status", "r"],
            1,
            Stderr,
            &["Redis at 127.0.0.1:1 refused the connection"],
            &["did not answer", "Connection refused"],
        ),
        case(
            "a PostgreSQL issuer nobody listens at: host:port, refused",
            &[("PGFENCE_ISSUER_URL", "postgres://u:hunter2@127.0.0.1:1/db")],
            &["lock", "status", "r"],
            1,
            Stderr,
            &["PostgreSQL at 127.0.0.1:1 refused the connection"],
            &["pool timed out", "hunter2", "did not answer"],
        ),
        case(
            "a PostgreSQL issuer URL with a bad port",
            &[(
                "PGFENCE_ISSUER_URL",
                "postgres://u:hunter2@db.internal:xx/db",
            )],
            &["lock", "status", "r"],
            1,
            Stderr,
            &[
                "the PostgreSQL URL \"postgres://u:***@db.internal:xx/db\" did not parse",
                "invalid port",
            ],
            &["hunter2", "cannot connect"],
        ),
        case(
            "doctor: a URL that did not parse is not 'cannot connect'",
            &[
                pg,
                ("REDIS_URL", "redis://:hunter2@cache.internal:notaport"),
            ],
            &["doctor", "--no-scan"],
            1,
            Stdout,
            &[
                "invalid_issuer_url",
                "\"redis://:***@cache.internal:notaport\" did not parse",
                "correct the URL",
            ],
            &["cannot connect", "hunter2", "redis_unavailable"],
        ),
        case(
            "grant as the application role: the command and the role to run it as",
            &[as_app],
            &["grant", &other.name],
            1,
            Stderr,
            &[
                "`pgfence grant` is a deploy-time command",
                &grant_msg,
                &not_as_app,
                // Refused before PostgreSQL is asked: it says why instead of relaying a
                // "permission denied".
                "does not own schema pgfence",
            ],
            &["permission denied"],
        ),
        case(
            "audit as the application role: who may read it",
            &[as_app],
            &["audit"],
            1,
            Stderr,
            &["`pgfence audit`", &grant_msg, &not_as_app],
            &[],
        ),
        case(
            "tables as the application role: who may read them, as audit says",
            &[as_app],
            &["tables"],
            1,
            Stderr,
            &[
                "`pgfence tables` reads pgfence.guarded_tables",
                &grant_msg,
                &not_as_app,
                "permission denied for view guarded_tables",
            ],
            &["database error", "SQLSTATE"],
        ),
        case(
            "doctor as a role pgfence grant never ran for: a problem, naming the grant",
            &[as_stranger],
            &["doctor", "--no-redis"],
            1,
            Stdout,
            &[
                "not_granted",
                "lacks pgfence's grants",
                &grant_stranger,
                "1 problem(s) found",
            ],
            &["ok: no problems found", "not_permitted"],
        ),
        case(
            "tables as a role pgfence grant never ran for",
            &[as_stranger],
            &["tables"],
            1,
            Stderr,
            &[
                "`pgfence tables`",
                &grant_msg,
                "permission denied for schema pgfence",
            ],
            &["database error"],
        ),
        case(
            "audit prune as the application role",
            &[as_app],
            &["audit", "prune", "--older-than", "30d"],
            1,
            Stderr,
            &["`pgfence audit prune`", &grant_msg],
            &[],
        ),
        case(
            "audit: a filter that matches only another key prefix's rows says which prefix",
            &[pg],
            &["audit", "--resource", &audit_r],
            0,
            Stderr,
            &[
                "no rejected writes for",
                "1 under key prefix nu4",
                prefix_hint,
            ],
            &[],
        ),
        case(
            "audit: stdout says under which prefix nothing was found",
            &[pg],
            &["audit", "--resource", &audit_r],
            0,
            Stdout,
            &["no rejected writes for", "under key prefix pgfence"],
            &[],
        ),
        case(
            "audit with the service's prefix lists the row by the name the service wrote",
            &[pg, ("PGFENCE_KEY_PREFIX", "nu4")],
            &["audit", "--resource", &audit_r],
            0,
            Stdout,
            &["key prefix", "nu4", &format!("{stem}:14")],
            &["nu4{", "no rejected writes"],
        ),
        case(
            "audit --json keeps the stored name and adds key_prefix and name",
            &[pg, ("PGFENCE_KEY_PREFIX", "nu4")],
            &["audit", "--resource", &audit_r, "--json"],
            0,
            Stdout,
            &[
                &format!("\"resource\": \"nu4{{{stem}:14\""),
                "\"key_prefix\": \"nu4\"",
                &format!("\"name\": \"{stem}:14\""),
            ],
            &[],
        ),
        case(
            "lock status: free here, but the service's prefix has a counter",
            &[with_redis],
            &["lock", "status", &status_r],
            0,
            Stderr,
            &["key prefix nu4 (counter=14)", prefix_hint],
            &[],
        ),
        case(
            "lock status under the service's prefix names the prefix and finds the counter",
            &[with_redis, ("PGFENCE_KEY_PREFIX", "nu4")],
            &["lock", "status", &status_r],
            0,
            Stdout,
            &["(key prefix nu4): free; counter=14"],
            &[],
        ),
        case(
            "doctor --resource R: R has a mark only under the service's key prefix",
            &[pg, with_redis],
            &["doctor", "--no-scan", "--resource", &format!("{stem}:2")],
            1,
            Stdout,
            &[
                "no high-water mark under key prefix pgfence, but one under key prefix nu4 (token 40)",
                &format!("pgfence doctor --key-prefix nu4 --resource '{stem}:2'"),
                "under key prefix nu4",
            ],
            &[],
        ),
        case(
            "doctor as the application role: not_permitted only is not a failure",
            &[as_app],
            &["doctor", "--no-redis"],
            0,
            Stdout,
            &[
                "not_permitted",
                "ok: no problems found",
                "not permitted to this role",
            ],
            &[],
        ),
        case(
            "doctor as the application role still fails on a real problem",
            &[as_app, with_redis],
            &["doctor", "--resource", below.as_str()],
            1,
            Stdout,
            &["counter_below_mark", "1 problem(s) found"],
            &[],
        ),
        case(
            "doctor as the application role with an issuer that does not answer: a problem",
            &[as_app, no_redis],
            &["doctor"],
            1,
            Stdout,
            &["redis_unavailable", "refused the connection"],
            &[],
        ),
    ];
    let mut failed = Vec::new();
    for c in &cases {
        let env: Vec<(&str, &str)> = c.env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let args: Vec<&str> = c.args.iter().map(String::as_str).collect();
        let out = run(&env, &args);
        let shown = match c.stream {
            Stream::Stdout => text(&out.stdout),
            Stream::Stderr => text(&out.stderr),
        };
        let missing: Vec<&String> = c
            .must
            .iter()
            .filter(|m| !shown.contains(m.as_str()))
            .collect();
        let present: Vec<&&str> = c.must_not.iter().filter(|m| shown.contains(**m)).collect();
        if out.status.code() != Some(c.code) || !missing.is_empty() || !present.is_empty() {
            failed.push(format!(
                "{}: exit {:?} (want {}), {:?} missing {missing:?}, must not show {present:?}\n  stdout: {}\n  stderr: {}",
                c.what,
                out.status.code(),
                c.code,
                c.stream,
                text(&out.stdout).trim_end(),
                text(&out.stderr).trim_end()
            ));
        }
    }
    let _: () = redis::cmd("DEL")
        .arg(&counter_key)
        .query_async(&mut redis_conn)
        .await
        .unwrap();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// Every command that prints, with its stdout a pipe whose reader is gone (`pgfence audit |
/// head` once head has exited): a quiet end, exit 0 or 141, nothing on stderr.
#[tokio::test]
async fn a_closed_stdout_ends_every_command_quietly() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE jobs (id int PRIMARY KEY);
         INSERT INTO pgfence.audit (resource, presented, current, operation) VALUES ('r:1', 1, 2, 'check');",
    )
    .await;
    let url = db.url();
    let redis = redis_url().await;
    assert!(
        run(&[("DATABASE_URL", &url)], &["guard", "jobs"])
            .status
            .success()
    );
    let r = unique_resource("pipe").as_str().to_owned();
    let commands: Vec<Vec<&str>> = vec![
        vec!["audit"],
        vec!["audit", "--json"],
        vec!["migrate", "--status"],
        vec!["migrate"],
        vec!["tables"],
        vec!["tables", "--json"],
        vec!["doctor"],
        vec!["doctor", "--json"],
        vec!["lock", "status", &r],
        vec!["lock", "status", &r, "--json"],
        vec!["reseed", &r],
    ];
    let mut failed = Vec::new();
    for args in &commands {
        let (reader, writer) = std::io::pipe().unwrap();
        // The reader is gone before pgfence writes anything.
        drop(reader);
        let out = Command::new(bin())
            .args(args)
            .env("DATABASE_URL", &url)
            .env("REDIS_URL", &redis)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let err = text(&out.stderr);
        if !matches!(out.status.code(), Some(0 | 141)) || !err.trim().is_empty() {
            failed.push(format!(
                "{args:?}: exit {:?}, stderr: {err}",
                out.status.code()
            ));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
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
