//! The examples run and assert their own outcomes (`cargo test` builds them first).

use crate::support;

use std::path::PathBuf;
use std::process::Command;

fn example(name: &str) -> PathBuf {
    // tests live in target/<profile>/deps; examples in target/<profile>/examples.
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name)
}

#[tokio::test]
async fn payment_reconciliation_leaves_exactly_one_set_of_payments() {
    let out = Command::new(example("payment_reconciliation"))
        .env("DATABASE_URL", support::pg_url().await)
        .env("REDIS_URL", support::redis_url().await)
        .output()
        .expect("the example is built by cargo test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("A: ledger write REJECTED"), "{stdout}");
    assert!(stdout.contains("exactly one set of payments"), "{stdout}");
}

/// The metrics example (built when the `metrics` feature is on, as `cargo test` at the
/// workspace root does) exposes the documented metric names after a write and a rejection.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn metrics_example_exposes_the_documented_names() {
    let out = Command::new(example("metrics"))
        .env("DATABASE_URL", support::pg_url().await)
        .output()
        .expect("the example is built by cargo test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for name in [
        "pgfence_rejections_total{",
        "kind=\"stale\"",
        "pgfence_write_seconds",
        "operation=\"update\"",
    ] {
        assert!(stdout.contains(name), "{name} missing from:\n{stdout}");
    }
    assert!(!stdout.contains("resource="), "a resource label:\n{stdout}");
}
