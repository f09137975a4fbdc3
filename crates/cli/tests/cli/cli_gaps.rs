//! Small gaps in the CLI (issue 20, point 8): `run --help` lists what the command gets,
//! `guard --help` shows the migration file name whole, the audit text view shows
//! `application_name` and `reason`, and an error is one line with no warning before it.

use crate::support;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use redis::AsyncCommands;
use support::{TestDb, redis_url, unique_resource};

/// `pgfence ARGS` with exactly the given server variables (none inherited from the test's
/// environment, nor any other `PGFENCE_*` variable).
fn pgfence(env: &[(&str, &str)], args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pgfence"));
    c.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .env_remove("RUST_LOG")
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null());
    for (name, _) in std::env::vars().filter(|(n, _)| n.starts_with("PGFENCE_")) {
        c.env_remove(name);
    }
    c.envs(env.iter().copied());
    c
}

fn output(env: &[(&str, &str)], args: &[&str]) -> Output {
    pgfence(env, args).output().expect("run pgfence")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The stdout of a run that must succeed.
#[track_caller]
fn ok(out: &Output) -> String {
    assert!(out.status.success(), "failed: {}", text(&out.stderr));
    text(&out.stdout)
}

/// The variables `pgfence run --help` lists for the command's environment.
fn help_variables() -> BTreeSet<String> {
    let help = ok(&output(&[], &["run", "--help"]));
    let (_, list) = help
        .split_once("The command gets these variables in its environment:")
        .unwrap_or_else(|| panic!("no list of the command's variables: {help}"));
    list.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| w.starts_with("PGFENCE_"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn run_help_mentions_pgfence_tag() {
    let help = ok(&output(&[], &["run", "--help"]));
    for name in [
        "PGFENCE_TOKEN",
        "PGFENCE_RESOURCE",
        "PGFENCE_OWNER",
        "PGFENCE_TAG",
    ] {
        assert!(help.contains(name), "{name} missing: {help}");
    }
    // The short help too.
    assert!(ok(&output(&[], &["run", "-h"])).contains("PGFENCE_TAG"));
}

/// The help's list is exactly what the command finds in its environment.
#[tokio::test]
async fn run_help_lists_exactly_the_commands_variables() {
    let redis = redis_url().await;
    let res = unique_resource("gaps-env");
    let out = output(
        &[("REDIS_URL", &redis)],
        &[
            "run",
            "--resource",
            res.as_str(),
            "--ttl",
            "5s",
            "--",
            "env",
        ],
    );
    let got: BTreeSet<String> = ok(&out)
        .lines()
        .filter_map(|l| l.split_once('=').map(|(name, _)| name))
        .filter(|n| n.starts_with("PGFENCE_"))
        .map(str::to_owned)
        .collect();
    assert!(got.contains("PGFENCE_TAG"), "{got:?}");
    assert_eq!(help_variables(), got);
}

#[test]
fn guard_help_shows_the_migration_file_name_on_one_line() {
    for flag in ["--help", "-h"] {
        let help = ok(&output(&[], &["guard", flag]));
        let line = help
            .lines()
            .find(|l| l.contains("--emit-migration"))
            .unwrap_or_else(|| panic!("no --emit-migration: {help}"));
        assert!(
            line.contains("V{n}__guard_<table>.sql"),
            "the file name is cut: {help}"
        );
        assert!(
            !help.contains('\x1b'),
            "escape codes in piped help: {help:?}"
        );
    }
}

/// One audit row per line, `app=` and `reason=` when recorded, quoted so that a hostile
/// `application_name` cannot forge a line or a field.
#[tokio::test]
async fn audit_text_shows_application_name_and_reason() {
    let db = TestDb::new().await;
    db.exec(
        r#"INSERT INTO pgfence.audit (resource, presented, current, holder, operation, application_name, reason)
           VALUES ('gaps:plain', 1, 2, 'w', 'check', NULL, NULL),
                  ('gaps:plain', 1, 2, 'w', 'check', '', NULL),
                  ('gaps:app', 3, 4, 'w', 'update', E'evil\n99 2099-01-01T00:00:00Z check forged', NULL),
                  ('gaps:both', 5, 6, 'w', 'bypass', 'psql', E'hotfix "42" app=forged\nsecond line')"#,
    )
    .await;
    let url = db.url();
    let env = [("DATABASE_URL", url.as_str())];

    let table = ok(&output(&env, &["audit"]));
    assert_eq!(table.lines().count(), 5, "header + 4 rows: {table}");
    let header = table.lines().next().unwrap();
    assert!(header.trim_end().ends_with("details"), "{header}");
    let row =
        |resource: &str| -> Vec<&str> { table.lines().filter(|l| l.contains(resource)).collect() };
    for plain in row("gaps:plain") {
        assert!(
            !plain.contains("app=") && !plain.contains("reason="),
            "{plain}"
        );
    }
    let app = row("gaps:app");
    assert_eq!(app.len(), 1, "{table}");
    assert!(
        app[0].ends_with(r#"app="evil\n99 2099-01-01T00:00:00Z check forged""#),
        "{}",
        app[0]
    );
    let both = row("gaps:both");
    assert_eq!(both.len(), 1, "{table}");
    assert!(
        both[0].ends_with(r#"app="psql" reason="hotfix \"42\" app=forged\nsecond line""#),
        "{}",
        both[0]
    );

    // Without either in any row: no details column.
    let plain = ok(&output(&env, &["audit", "--resource", "gaps:plain"]));
    assert!(!plain.contains("details"), "{plain}");

    // `--follow`: one line per row as well.
    let mut child = pgfence(&env, &["audit", "--follow"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start pgfence");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let lines: Vec<String> = (0..4)
        .map(|_| rx.recv_timeout(Duration::from_secs(15)).expect("a line"))
        .collect();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "more lines than rows: {lines:?}"
    );
    assert!(lines[0].ends_with("holder=w"), "{lines:?}");
    assert!(lines[1].ends_with("holder=w"), "{lines:?}");
    assert!(
        lines[2].ends_with(r#"holder=w app="evil\n99 2099-01-01T00:00:00Z check forged""#),
        "{lines:?}"
    );
    assert!(
        lines[3].ends_with(r#"holder=w app="psql" reason="hotfix \"42\" app=forged\nsecond line""#),
        "{lines:?}"
    );
}

/// Fails with exactly one non-empty line on stderr, and returns it.
#[track_caller]
fn one_line_error(out: &Output) -> String {
    assert!(!out.status.success(), "should fail: {}", text(&out.stdout));
    assert_ne!(out.status.code(), Some(101), "panicked");
    let err = text(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "exactly one line: {err}");
    assert!(lines[0].starts_with("pgfence: "), "{err}");
    lines[0].to_owned()
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
