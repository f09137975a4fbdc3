//! `pgfence` with exactly the given server variables (none inherited from the test's
//! environment), and what to make of its output.

use std::process::{Command, Output, Stdio};

use super::text;

/// `pgfence ARGS` with exactly the given server variables (none inherited from the test's
/// environment, nor any other `PGFENCE_*` variable).
pub(crate) fn pgfence(env: &[(&str, &str)], args: &[&str]) -> Command {
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

pub(crate) fn output(env: &[(&str, &str)], args: &[&str]) -> Output {
    pgfence(env, args).output().expect("run pgfence")
}

/// The stdout of a run that must succeed.
#[track_caller]
pub(crate) fn ok(out: &Output) -> String {
    assert!(out.status.success(), "failed: {}", text(&out.stderr));
    text(&out.stdout)
}

/// Fails with exactly one non-empty line on stderr, and returns it.
#[track_caller]
pub(crate) fn one_line_error(out: &Output) -> String {
    assert!(!out.status.success(), "should fail: {}", text(&out.stdout));
    assert_ne!(out.status.code(), Some(101), "panicked");
    let err = text(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "exactly one line: {err}");
    assert!(lines[0].starts_with("pgfence: "), "{err}");
    lines[0].to_owned()
}
