//! A re-enqueued task's zombie, for real: two apalis-postgres worker processes and a payment
//! provider on loopback that honours `Idempotency-Key`.
//!
//! Worker A takes the task "charge invoice N" and is stopped (`SIGSTOP`) right before its
//! provider call, past its missed heartbeats; apalis re-enqueues the task and worker B runs it
//! to the end; then A is resumed (`SIGCONT`) and finishes its run, unaware.
//!
//! ```sh
//! cargo run -p pgfence-apalis --example zombie              # the handler under FenceLayer
//! cargo run -p pgfence-apalis --example zombie -- --no-fence  # the same job without pgfence
//! ```
//!
//! Uses `DATABASE_URL` when set (it creates the schema `pgfence_apalis_demo`, pgfence's and
//! apalis's schemas if missing, and removes its rows afterwards), else a throwaway PostgreSQL.
//! Only PostgreSQL is needed: the leases come from pgfence's PostgreSQL issuer. Exits
//! non-zero unless the fenced run charged once and kept B's result (or, with `--no-fence`,
//! unless the zombie's double write and double charge showed).
// A command-line demo: printing is its job.
#![allow(clippy::print_stdout)]

mod scenario;
mod worker;

use apalis_core::error::BoxDynError;
use pgfence_testkit::{Kind, url_or_start};
use sqlx::PgPool;

#[tokio::main]
async fn main() -> Result<(), BoxDynError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The scenario starts its workers as this same program: `zombie worker ...`.
    if args.first().map(String::as_str) == Some("worker") {
        return worker::run(&args[1..]).await;
    }
    let fenced = !args.iter().any(|a| a == "--no-fence");
    let (db_url, _pg) = url_or_start(
        Kind::Postgres,
        std::env::var("DATABASE_URL").ok().as_deref(),
    )
    .await?;
    let pool = PgPool::connect(&db_url).await?;
    let command = scenario::WorkerCommand {
        program: std::env::current_exe()?,
        args: vec!["worker".into()],
    };
    let start = std::time::Instant::now();
    let report = scenario::run(&pool, &db_url, &command, fenced, &|line| {
        println!("{:>7}ms  {line}", start.elapsed().as_millis());
    })
    .await?;
    scenario::clean_up(&pool, &report).await?;

    let r = &report;
    println!();
    println!(
        "invoice:  status {}, paid by {}, marked paid {} time(s)",
        r.invoice.status,
        r.invoice.paid_by.as_deref().unwrap_or("-"),
        r.invoice.paid_writes
    );
    println!(
        "provider: {} charge(s); {} late call(s) replayed, {} refused as in flight",
        r.charges, r.replays, r.conflicts
    );
    println!(
        "apalis:   task {} by {} ({})",
        r.job_final.status,
        r.job_final.lock_by.as_deref().unwrap_or("-"),
        r.job_final
            .last_result
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default()
    );
    println!("audit:    {} rejection(s) of A's lease", r.audit.len());
    for a in &r.audit {
        println!(
            "          {} {} with token {} (newer token {})",
            a.operation,
            a.table_name.as_deref().unwrap_or("(resource)"),
            a.presented,
            a.current.map(|c| c.to_string()).unwrap_or("?".into())
        );
    }
    for line in r
        .zombie_log
        .lines()
        .filter(|l| l.contains("pgfence::audit"))
    {
        println!("A's log:  {line}");
    }
    println!("took {:.1}s", r.took.as_secs_f64());

    let held = r.charges == 1
        && r.invoice.paid_writes == 1
        && r.invoice.paid_by.as_deref() == Some(r.live.as_str())
        && r.job_final == r.job_after_live;
    if fenced && !held {
        return Err("the zombie got through: see above".into());
    }
    if !fenced && held {
        return Err("the unfenced control did not show the zombie's double write".into());
    }
    println!(
        "{}",
        if fenced {
            "one charge, B's result kept, A's late write refused and audited: the fence held"
        } else {
            "without pgfence: A's late write overwrote B's and the provider charged twice"
        }
    );
    Ok(())
}
