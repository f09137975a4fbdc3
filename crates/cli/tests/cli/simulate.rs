//! `pgfence simulate`: the demo race on servers it starts itself or on PostgreSQL alone,
//! without fencing, as a Mermaid diagram; and `--pg-failover`, the race across a failover of
//! the database itself.
//!
//! With `--pg-failover`, on a throwaway primary and asynchronous standby, lease B's
//! acknowledged write is lost by the promotion, the row shows zombie A's fence again, and
//! pgfence must refuse A (`FencedByFailover`) while the 0.2-style control (a check without a
//! timeline) lets it in and a new lease C writes. Exit 0 only when that is what happened.

use crate::common::{BIN, Cli};
use crate::support;

use std::process::{Command, Output};

use support::TestDb;

/// The index of the one line of `out` that contains `needle`.
fn line_of(out: &str, needle: &str) -> usize {
    let found: Vec<usize> = out
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains(needle))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(found.len(), 1, "{needle:?} once in:\n{out}");
    found[0]
}

/// The demo on a machine where the servers are installed but not running: it starts its own,
/// shows the rejection, and leaves no process or directory behind. The story: A writes step 1,
/// records the charge and pauses right before calling the provider; B claims the row, records
/// the charge (the same idempotency key), calls the provider and writes twice under one lease;
/// A, the zombie, wakes between B's two writes, calls with the same key (nothing charged) and
/// its step 2 is rejected; B's second write still applies. One charge at the provider.
#[tokio::test]
async fn simulate_starts_and_removes_its_own_servers() {
    let out = Command::new(BIN)
        .arg("simulate")
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    line_of(
        &stdout,
        "A      claims batch-42 with token 1: status = pending",
    );
    let a_first = line_of(
        &stdout,
        "A      step 1: writes status = processing by A with token 1: applied",
    );
    let a_effect = line_of(
        &stdout,
        "A      records the charge in the effect ledger: idempotency key ",
    );
    let key = stdout.lines().nth(a_effect).unwrap();
    let key = &key[key.find("idempotency key ").unwrap() + 16..][..8];
    let b_claim = line_of(
        &stdout,
        "B      claims batch-42 with token 2: status = processing by A",
    );
    let b_first = line_of(
        &stdout,
        "B      step 1: writes status = processing by B with token 2: applied",
    );
    let b_effect = line_of(
        &stdout,
        &format!(
            "B      records the charge in the effect ledger: idempotency key {key}… (the same"
        ),
    );
    let a_call = line_of(
        &stdout,
        &format!("A      calls the payment provider with Idempotency-Key {key}…"),
    );
    let a_answer = stdout
        .lines()
        .nth(a_call + 1)
        .unwrap_or_default()
        .to_owned();
    assert!(
        a_answer.contains("A      provider answers 409 Conflict")
            || a_answer.contains("replayed for the same key, nothing charged"),
        "{stdout}"
    );
    let a_rejected = line_of(
        &stdout,
        "A      step 2: writes status = paid, paid_by = A with token 1: \
         REJECTED: stale token (presented 1, current 2)",
    );
    assert!(a_first < a_effect && a_effect < b_claim && b_effect < a_call && a_call < a_rejected);
    let b_second = line_of(
        &stdout,
        "B      step 2: writes status = paid, paid_by = B with token 2: \
         applied (same lease, second write)",
    );
    assert!(
        b_claim < b_first && b_first < a_rejected && a_rejected < b_second,
        "A's rejection between B's two writes:\n{stdout}"
    );
    line_of(&stdout, "A      stops: a newer lease owns batch-42");
    assert!(
        stdout.contains(
            "provider: 1 charge(s) for batch-42; A's late call carried B's idempotency key"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "result: the row holds B's final write (status = paid, paid_by = B, fence = 2)"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("audit:  1 rejected write(s)") && stdout.contains("fencing works."),
        "{stdout}"
    );
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("pgfence::audit") && stderr.contains("presented=1 current=2"),
        "log event: {stderr}"
    );

    let dirs: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("stopped throwaway server, removed "))
        .collect();
    assert_eq!(dirs.len(), 2, "{stdout}");
    for dir in dirs {
        assert!(!std::path::Path::new(dir).exists(), "{dir} left behind");
        let procs = Command::new("pgrep").args(["-f", dir]).output().unwrap();
        assert!(procs.stdout.is_empty(), "process left behind for {dir}");
    }
}

/// With only PostgreSQL installed (the test hides redis-server), the demo says that
/// `--issuer postgres` works, and with it runs the whole race on one throwaway PostgreSQL: the
/// PostgreSQL issuer hands out tokens 1 and 2, A's stale write is rejected and audited.
#[tokio::test]
async fn simulate_runs_on_postgres_alone() {
    let run = |args: &[&str]| {
        Command::new(BIN)
            .args(args)
            .env_remove("DATABASE_URL")
            .env_remove("REDIS_URL")
            .env_remove("PGFENCE_ISSUER_URL")
            .env("PGFENCE_REDIS_SERVER", "/nonexistent/redis-server")
            .output()
            .unwrap()
    };
    let out = run(&["simulate"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("redis-server") && stderr.contains("pgfence simulate --issuer postgres"),
        "{stderr}"
    );
    let out = run(&["simulate", "--issuer", "postgres"]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    line_of(&stdout, "issuer:   the PostgreSQL issuer");
    line_of(
        &stdout,
        "A      acquires the lock (TTL 300ms) -> fence token 1",
    );
    line_of(
        &stdout,
        "B      acquires the lock (TTL 700ms) -> fence token 2",
    );
    line_of(
        &stdout,
        "A      step 2: writes status = paid, paid_by = A with token 1: \
         REJECTED: stale token (presented 1, current 2)",
    );
    assert!(
        stdout.contains("audit:  1 rejected write(s)") && stdout.contains("fencing works."),
        "{stdout}"
    );
    assert!(stdout.contains("provider: 1 charge(s)"), "{stdout}");
    let dirs: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("stopped throwaway server, removed "))
        .collect();
    assert_eq!(dirs.len(), 1, "PostgreSQL only: {stdout}");
    // Unfenced, on the same issuer: A's stale writes land.
    let out = run(&["simulate", "--issuer", "postgres", "--no-fence"]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("paid_by = A"), "{stdout}");
    // --issuer postgres with another issuer URL is refused.
    let out = Command::new(BIN)
        .args([
            "simulate",
            "--issuer",
            "postgres",
            "--issuer-url",
            "redis://127.0.0.1:1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--issuer postgres"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn simulate_without_fencing_shows_the_damage_and_leaves_no_demo_table() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let out = cli.ok(&["simulate", "--no-fence"]);
    // The same job without fencing (and without the ledger's key): A's writes land, its
    // step 2 over B's, and the provider charges twice.
    let a_first = line_of(
        &out,
        "A      step 1: writes status = processing by A: applied (no fence to check)",
    );
    let b_first = line_of(
        &out,
        "B      step 1: writes status = processing by B: applied (no fence to check)",
    );
    let b_second = line_of(
        &out,
        "B      step 2: writes status = paid, paid_by = B: applied (no fence to check)",
    );
    let a_second = line_of(
        &out,
        "A      step 2: writes status = paid, paid_by = A: applied (no fence to check)",
    );
    assert!(
        a_first < b_first && b_first < b_second && b_second < a_second,
        "{out}"
    );
    assert_eq!(
        out.matches("calls the payment provider without an idempotency key")
            .count(),
        2,
        "{out}"
    );
    assert!(out.contains("provider: 2 charge(s) for batch-42"), "{out}");
    assert!(!out.contains("REJECTED"), "{out}");
    assert!(
        out.contains("result: the row says status = paid, paid_by = A"),
        "{out}"
    );
    assert!(
        out.contains(
            "DAMAGE: A's stale writes (token 1, unfenced) overwrote B's newer writes (token 2)"
        ),
        "{out}"
    );
    let demo: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE tablename LIKE 'pgfence_demo%'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(demo, 0);
}

#[tokio::test]
async fn simulate_mermaid_is_a_sequence_diagram() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let out = cli.ok(&["simulate", "--mermaid"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "sequenceDiagram");
    for actor in [
        "A as Worker A",
        "R as Lock service",
        "P as Postgres",
        "V as Payment provider",
        "B as Worker B",
    ] {
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.trim() == format!("participant {actor}"))
                .count(),
            1,
            "{actor}"
        );
    }
    let arrows = lines
        .iter()
        .filter(|l| l.contains("->>") || l.contains("-->>") || l.contains("--x"))
        .count();
    assert!(arrows >= 12, "{out}");
    assert!(out.contains("P--xA: REJECTED"), "{out}");
    assert_eq!(
        out.matches("->>V: ").count(),
        2,
        "both call the provider: {out}"
    );
    assert_eq!(
        out.matches("POST /charges Idempotency-Key").count(),
        2,
        "{out}"
    );
    assert!(!out.contains("P--xB"), "{out}");
    assert_eq!(out.matches("P-->>B: applied").count(), 2, "{out}");
    assert!(
        out.contains("B->>P: ") && out.contains("claim batch-42 fence=2"),
        "{out}"
    );
    assert!(
        out.contains("step 2 UPDATE status = paid, paid_by = B fence=2"),
        "{out}"
    );
    // Every line after the header is a participant, a message, or a note.
    for l in &lines[1..] {
        let l = l.trim();
        assert!(
            l.starts_with("participant ") || l.starts_with("Note over ") || l.contains(": "),
            "not Mermaid: {l}"
        );
    }
    assert_eq!(
        support::audit_count(&db.pool).await,
        0,
        "demo audit rows removed"
    );
}

fn simulate(args: &[&str], database_url: Option<&str>) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.arg("simulate")
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .env_remove("PGFENCE_ISSUER_URL");
    if let Some(url) = database_url {
        cmd.env("DATABASE_URL", url);
    }
    cmd.output().expect("run pgfence")
}

/// The index of the first line of `out` at or after `from` that contains `needle`.
fn line_after(out: &str, from: usize, needle: &str) -> usize {
    out.lines()
        .enumerate()
        .skip(from)
        .find(|(_, l)| l.contains(needle))
        .map(|(i, _)| i)
        .unwrap_or_else(|| panic!("no line with {needle:?} after line {from} in:\n{out}"))
}

/// The story in order, as `simulate --pg-failover` tells it; returns the C line's index.
fn assert_story(out: &str) -> usize {
    let mut at = line_after(out, 0, "A  takes the lock: token 1");
    at = line_after(out, at, "writes the row with token 1: applied");
    at = line_after(out, at, "the standby has replayed A's write");
    at = line_after(out, at, "-- the standby is cut off");
    at = line_after(out, at, "B  takes the lock: token 2");
    at = line_after(
        out,
        at,
        "B  writes the row with token 2: applied (acknowledged by the primary only)",
    );
    at = line_after(
        out,
        at,
        "A  wakes and writes with token 1: REJECTED: stale token (presented 1, current 2)",
    );
    at = line_after(out, at, "(timeline 1 -> 2)");
    at = line_after(
        out,
        at,
        "status = \"written by A\", fence token 1: B's write is gone, the row looks like A's again",
    );
    at = line_after(
        out,
        at,
        "A  (zombie) writes again with token 1: REFUSED: FencedByFailover (lease bound to timeline 1, database on timeline 2)",
    );
    at = line_after(
        out,
        at,
        "no timeline: ACCEPTED (0.2 let the zombie back in)",
    );
    line_after(out, at, "C  writes the row with token")
}

#[test]
fn pg_failover_refuses_the_zombie_a_lost_write_let_back_in() {
    // A configured database is left alone: the demo always starts its own pair.
    let out = simulate(
        &["--pg-failover"],
        Some("postgres://nobody@127.0.0.1:1/not-used"),
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains("DATABASE_URL / --database-url is left alone"),
        "{stdout}"
    );
    let c = assert_story(&stdout);
    assert!(
        stdout
            .lines()
            .nth(c)
            .unwrap()
            .ends_with("with token 3: applied"),
        "{stdout}"
    );
    let audit = line_after(&stdout, c, "pgfence.audit for demo:payments:batch-42:");
    // The refusal after the promotion is audited (A's stale rejection was lost with it).
    line_after(&stdout, audit, "presented 1");
    line_after(
        &stdout,
        audit,
        "final row: status = \"written by C\", fence token 3",
    );
    line_after(
        &stdout,
        audit,
        "verdict: the promotion lost B's acknowledged write",
    );
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        out.status
    );
}

#[test]
fn pg_failover_with_the_postgres_issuer_says_its_counter_rolled_back() {
    let out = simulate(&["--pg-failover", "--issuer", "postgres"], None);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains("the PostgreSQL issuer, on the same primary"),
        "{stdout}"
    );
    let c = assert_story(&stdout);
    // The counter went back with the database: C gets B's lost token again.
    assert!(
        stdout
            .lines()
            .nth(c)
            .unwrap()
            .ends_with("with token 2: applied"),
        "{stdout}"
    );
    line_after(&stdout, c, "B's token 2 was lost with it, and C got 2");
    line_after(
        &stdout,
        c,
        "final row: status = \"written by C\", fence token 2",
    );
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        out.status
    );
}

#[test]
fn pg_failover_refuses_what_it_cannot_show() {
    for (args, says) in [
        (&["--pg-failover", "--no-fence"][..], "drop --no-fence"),
        (&["--pg-failover", "--mermaid"][..], "drop --mermaid"),
        (
            &["--pg-failover", "--issuer-url", "etcd://127.0.0.1:2379"][..],
            "drop --issuer-url",
        ),
    ] {
        let out = simulate(args, None);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?} started something");
    }
}
