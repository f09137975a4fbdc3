//! `pgfence run`: the token in the command's environment and its exit code, a shell job's
//! fenced transactions, signals (SIGTERM, SIGINT, SIGKILL), `--help`'s variables. Submodules:
//! [`on_lease_lost`], the README's shell recipe ([`shell_path`]) and a paused ZooKeeper holder
//! ([`zk_paused_process`]).

use crate::common::exact_env::{ok, output};
use crate::common::{BIN, Cli};
use crate::support;

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::{TestDb, redis_url, unique_resource};

mod on_lease_lost;
mod shell_path;
mod zk_paused_process;

#[tokio::test]
async fn run_exports_the_token_and_propagates_the_exit_code() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let res = unique_resource("cli-run");
    let r = res.as_str();
    let out = cli.run(&[
        "run",
        "--resource",
        r,
        "--ttl",
        "2s",
        "--",
        "sh",
        "-c",
        "echo \"$PGFENCE_TOKEN $PGFENCE_RESOURCE\"; exit 7",
    ]);
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        format!("1 {r}")
    );
    assert!(
        cli.ok(&["lock", "status", r]).contains("free"),
        "released after the command exited"
    );

    let out = cli.run(&["run", "--resource", r, "--ttl", "2s", "--", "true"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        cli.fails(&[
            "run",
            "--resource",
            r,
            "--ttl",
            "2s",
            "--",
            "/no/such/program"
        ])
        .contains("cannot run")
    );
    assert!(
        cli.ok(&["lock", "status", r]).contains("free"),
        "released when the command cannot start"
    );
}

/// The README's shell job: one `pgfence run` lease, several psql transactions (a resource
/// check in each, raw row writes through `pgfence.next_fence`); then a newer lease writes,
/// and the first lease's token is fenced out.
#[tokio::test]
async fn a_shell_job_makes_several_fenced_transactions_under_one_lease() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE invoices (id int PRIMARY KEY, status text NOT NULL);
         INSERT INTO invoices VALUES (42, 'open');
         CREATE TABLE ledger (amount int NOT NULL);",
    )
    .await;
    let cli = Cli::new(&db).await;
    cli.ok(&["guard", "invoices"]);
    let res = unique_resource("cli-shell-job");
    let r = res.as_str();
    let job = r#"
      set -e
      q() { psql "$DATABASE_URL" -qAt -v ON_ERROR_STOP=1 -c "$1"; }
      q "BEGIN; SELECT pgfence.check('$PGFENCE_RESOURCE', $PGFENCE_TOKEN, $PGFENCE_TAG); INSERT INTO ledger VALUES (1); COMMIT;"
      q "UPDATE invoices SET status = 'processing', fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG) WHERE id = 42"
      q "BEGIN; SELECT pgfence.check('$PGFENCE_RESOURCE', $PGFENCE_TOKEN, $PGFENCE_TAG); INSERT INTO ledger VALUES (2); COMMIT;"
      q "UPDATE invoices SET status = 'paid', fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG) WHERE id = 42"
      echo "$PGFENCE_TOKEN $PGFENCE_TAG"
    "#;
    let out = cli.run(&["run", "--resource", r, "--ttl", "5s", "--", "sh", "-c", job]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = String::from_utf8(out.stdout).unwrap();
    let (token, tag) = first.trim().split_once(' ').unwrap();
    let (token, tag): (i64, i32) = (token.parse().unwrap(), tag.parse().unwrap());
    let status: String = sqlx::query_scalar("SELECT status FROM invoices WHERE id = 42")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(status, "paid", "both writes of one lease applied");
    let ledger: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(ledger, 2, "both checked transactions committed");

    // A newer lease writes; the first lease's token is now stale, in SQL too.
    let newer = r#"psql "$DATABASE_URL" -qAt -v ON_ERROR_STOP=1 -c "BEGIN; SELECT pgfence.check('$PGFENCE_RESOURCE', $PGFENCE_TOKEN, $PGFENCE_TAG); UPDATE invoices SET status = 'refunded', fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG) WHERE id = 42; COMMIT;""#;
    cli.ok(&[
        "run",
        "--resource",
        r,
        "--ttl",
        "5s",
        "--",
        "sh",
        "-c",
        newer,
    ]);
    let zombie = sqlx::query(
        "UPDATE invoices SET status = 'zombie', fence = pgfence.next_fence(fence, $1, $2) WHERE id = 42",
    )
    .bind(token)
    .bind(tag)
    .execute(&db.pool)
    .await
    .unwrap_err();
    assert!(pgfence::Error::from(zombie).is_stale());
    let zombie = sqlx::query("SELECT pgfence.check($1, $2, $3)")
        .bind(r)
        .bind(token)
        .bind(tag)
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(pgfence::Error::from(zombie).is_stale());
}

/// Waits (up to 2.5 s) until `lock status` says `resource` is held.
async fn wait_until_held(cli: &Cli, resource: &str) -> bool {
    for _ in 0..50 {
        if cli.ok(&["lock", "status", resource]).contains("held by") {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Sends `signal` (`-TERM`, `-INT`) to `child` alone and waits for it to exit.
async fn signal_and_wait(mut child: std::process::Child, signal: &str) -> std::process::ExitStatus {
    Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap()
}

#[tokio::test]
async fn run_keeps_the_lease_and_releases_on_sigterm() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let res = unique_resource("cli-term");
    let r = res.as_str();
    let child = cli
        .cmd(&[
            "run",
            "--resource",
            r,
            "--ttl",
            "600ms",
            "--",
            "sleep",
            "30",
        ])
        .spawn()
        .unwrap();
    // Held, and still held after several TTLs thanks to the keep-alive.
    assert!(wait_until_held(&cli, r).await, "run took the lock");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        cli.ok(&["lock", "status", r]).contains("held by"),
        "kept alive past the TTL"
    );

    let status = signal_and_wait(child, "-TERM").await;
    assert_eq!(
        status.code(),
        Some(143),
        "exit status of the command killed by SIGTERM"
    );
    assert!(
        cli.ok(&["lock", "status", r]).contains("free"),
        "released on SIGTERM"
    );
}

#[tokio::test]
async fn run_releases_on_sigint_sent_to_pgfence_alone() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let res = unique_resource("cli-int");
    let r = res.as_str();
    let child = cli
        .cmd(&["run", "--resource", r, "--ttl", "2s", "--", "sleep", "30"])
        .spawn()
        .unwrap();
    assert!(wait_until_held(&cli, r).await, "run took the lock");
    let status = signal_and_wait(child, "-INT").await;
    assert_eq!(status.code(), Some(130), "the command got SIGINT");
    assert!(
        cli.ok(&["lock", "status", r]).contains("free"),
        "released on SIGINT"
    );
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
