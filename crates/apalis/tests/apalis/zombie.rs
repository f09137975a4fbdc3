//! The zombie, for real: apalis-postgres worker processes (`pgfence-apalis-test-worker`) and
//! a payment provider on loopback. Worker A is stopped (`SIGSTOP`) mid-task past its missed
//! heartbeats; apalis re-enqueues the task and worker B completes it; A is resumed. With
//! `FenceLayer` A's write is refused, logged and audited, the provider charges once and the
//! task is done once, with B's result. The control (the same job without the layer) shows
//! A's double write and the double charge.

use std::time::Duration;

use crate::scenario::{self, Report, WorkerCommand};
use crate::support::TestDb;

/// Bound on a whole scenario (it takes a few seconds).
const LIMIT: Duration = Duration::from_secs(60);

async fn run(db: &TestDb, fenced: bool) -> Report {
    let command = WorkerCommand {
        program: env!("CARGO_BIN_EXE_pgfence-apalis-test-worker").into(),
        args: Vec::new(),
    };
    let label = if fenced { "fenced" } else { "control" };
    let report = tokio::time::timeout(
        LIMIT,
        scenario::run(&db.pool, &db.url(), &command, fenced, &|line| {
            eprintln!("[{label}] {line}");
        }),
    )
    .await
    .unwrap_or_else(|_| panic!("the {label} scenario did not finish within {LIMIT:?}"))
    .unwrap_or_else(|e| panic!("the {label} scenario failed: {e}"));
    eprintln!("[{label}] {report:#?}");
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstopped_worker_is_fenced_out_after_its_task_is_reenqueued() {
    let db = TestDb::new().await;
    let r = run(&db, true).await;
    // A was stopped past its missed heartbeats: apalis-postgres judged it dead and
    // re-enqueued the task (attempts 0 -> 1; B's run is attempt 2), and B took it.
    assert_eq!(r.job_after_live.attempts, 2);

    // B ran the task to the end: one charge, B's write.
    assert!(
        r.live_outcome.starts_with("OUTCOME ok paid by worker-b"),
        "{}",
        r.live_outcome
    );
    assert_eq!(r.charges, 1, "the provider charged once");
    assert!(
        r.replays + r.conflicts >= 1,
        "A's late call carried B's key: {r:?}"
    );
    assert_eq!(r.invoice.status, "paid");
    assert_eq!(r.invoice.paid_by.as_deref(), Some(r.live.as_str()));
    assert_eq!(r.invoice.paid_writes, 1, "A's write did not land");

    // A's write was refused: StaleToken, audited and logged.
    let update = r
        .audit
        .iter()
        .find(|a| a.operation == "update")
        .unwrap_or_else(|| panic!("A's refused update is audited: {:?}", r.audit));
    assert_eq!(
        update.table_name.as_deref(),
        Some(r#""pgfence_apalis_demo"."invoices""#)
    );
    assert!(update.current.is_some_and(|c| c > update.presented));
    assert!(
        r.audit.iter().all(|a| a.presented == update.presented),
        "every refusal is A's lease: {:?}",
        r.audit
    );
    assert!(
        r.zombie_log.contains("pgfence::audit") && r.zombie_log.contains("stale"),
        "A logged the rejection:\n{}",
        r.zombie_log
    );

    // A's run reported Failed (lease lost), and apalis kept B's Done.
    assert!(
        r.zombie_outcome.starts_with("OUTCOME error") && r.zombie_outcome.contains("lease lost"),
        "{}",
        r.zombie_outcome
    );
    assert_eq!(r.job_after_live.status, "Done");
    assert_eq!(r.job_after_live.lock_by.as_deref(), Some(r.live.as_str()));
    assert_eq!(
        r.job_final, r.job_after_live,
        "A's late outcome did not touch the task"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_without_the_layer_writes_and_charges_twice() {
    let db = TestDb::new().await;
    let r = run(&db, false).await;
    assert!(
        r.live_outcome.starts_with("OUTCOME ok paid by worker-b"),
        "{}",
        r.live_outcome
    );
    // The zombie's double write and double charge.
    assert!(
        r.zombie_outcome.starts_with("OUTCOME ok"),
        "{}",
        r.zombie_outcome
    );
    assert_eq!(r.charges, 2, "the provider charged twice");
    assert_eq!(
        r.invoice.paid_writes, 2,
        "both runs marked the invoice paid"
    );
    assert_eq!(
        r.invoice.paid_by.as_deref(),
        Some(r.zombie.as_str()),
        "A's late write overwrote B's"
    );
    assert!(r.audit.is_empty());
}
