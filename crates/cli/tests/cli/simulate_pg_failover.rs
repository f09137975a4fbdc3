//! `pgfence simulate --pg-failover`: the race across a failover of the database itself, on a
//! throwaway primary and asynchronous standby. Lease B's acknowledged write is lost by the
//! promotion, the row shows zombie A's fence again, and pgfence must refuse A
//! (`FencedByFailover`) while the 0.2-style control (a check without a timeline) lets it in
//! and a new lease C writes. Exit 0 only when that is what happened.

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_pgfence");

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
