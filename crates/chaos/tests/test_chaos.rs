//! Proof under faults: the race harness (`pgfence_chaos`) at CI size against real servers, with
//! stalls past the TTL, Redis counter loss, killed backends, restarts and real issuer failovers
//! (Redis Sentinel, etcd, ZooKeeper: each skips when its servers are not installed); the
//! PostgreSQL issuer on the harness's own database through restarts and killed issuer
//! backends; the effects modes, whose job charges invoices at a real HTTP payment provider
//! through the effect ledger (no invoice charged twice; the control with a key per lease
//! charges some twice); plus deterministic cases for why the transaction-scope check is needed
//! and for error classification.
//!
//! Rejections are counted by each harness's own audit sink; reseeds by one global `tracing`
//! layer keyed by resource, so runs that happen concurrently in this binary do not mix.

use pgfence_test_support as support;

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

use pgfence::{
    Error, Fence, RedisIssuer, Repository, Resource, issuer::IssuerKind, table::TableName,
};
use pgfence_chaos::{
    ChaosError, Config, Deployment, FailoverEvent, FailoverFigures, Harness, LeaselessOutcome,
    Mode, Outcome, PgFailoverFigures, Recovery, Report, ReseedCounter, Target, pg_failover_at,
};
use pgfence_testkit::{PgReplicaSet, Replication, Server, needs, optional};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use support::{TestDb, redis_url, unique_resource};

// ---------------------------------------------------------------------------------------------
// ---------------------------------------------------------------------------------------------

/// Runs the harness and restarts `server` once 500 units are done (the fault is named
/// `fault` in the report). Returns the report and the server, which must outlive the run.
async fn run_with_restart(
    cfg: Config,
    target: &Target,
    mut server: Server,
    fault: &'static str,
) -> (Report, Server) {
    let started_before = server_start(&server).await;
    let harness = Harness::new(cfg, target)
        .await
        .unwrap()
        .with_reseed_counter(ReseedCounter::install_global().expect("reseed counter"))
        .expect("a Redis run counts reseeds");
    let ctl = harness.control();
    let restart = tokio::spawn(async move {
        if ctl.wait_for_units(500).await {
            ctl.mark_fault(fault);
            server.restart().await.expect("the server comes back");
        }
        server
    });
    let report = harness.run().await.unwrap();
    let server = restart.await.unwrap();
    eprintln!("{}{}", report.summary, report.summary.json());
    // Proof the fault happened: the server is a new process. (Workers need not see an error:
    // a restart can fall entirely between their statements.)
    assert_ne!(
        server_start(&server).await,
        started_before,
        "the {fault} did not happen"
    );
    (report, server)
}

/// Identifies the running server process: PostgreSQL's postmaster start time, Redis's run id.
async fn server_start(server: &Server) -> String {
    if server.url().starts_with("redis") {
        let client = redis::Client::open(server.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut conn)
            .await
            .unwrap();
        info.lines()
            .find(|l| l.starts_with("run_id:"))
            .unwrap_or_default()
            .to_owned()
    } else {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect(&server.url())
            .await
            .unwrap();
        let started: String = sqlx::query_scalar("SELECT pg_postmaster_start_time()::text")
            .fetch_one(&pool)
            .await
            .unwrap();
        pool.close().await;
        started
    }
}

async fn run(cfg: Config, target: &Target) -> Report {
    let harness = Harness::new(cfg, target)
        .await
        .expect("harness setup")
        .with_reseed_counter(ReseedCounter::install_global().expect("reseed counter"))
        .expect("a Redis run counts reseeds");
    let report = harness.run().await.expect("run");
    eprintln!("{}{}", report.summary, report.summary.json());
    report
}

/// Every failure a worker saw was one `is_retryable()` calls safe to retry.
fn assert_failures_retryable(report: &Report) {
    for a in &report.attempts {
        if let Outcome::Failed {
            retryable, error, ..
        } = &a.outcome
        {
            assert!(retryable, "non-retryable failure {error} in {a:?}");
        }
    }
}

/// The acceptance run: 8 workers, 2,000 units, stalls past the TTL, a counter reset and
/// killed backends. Fenced: no violation, no lost update, every rejection audited and logged,
/// writes resume after the reset. The same run unfenced: violations and lost updates.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fenced_run_holds_under_faults_and_the_unfenced_control_breaks() {
    let db = TestDb::new().await;
    let target = Target {
        database: db.options.clone(),
        issuer_url: redis_url().await,
    };
    let cfg = Config {
        workers: 8,
        rows: 8,
        units: 2_000,
        reset_counters_at: vec![900],
        kill_every: Some(Duration::from_millis(150)),
        // Recover the reset counters through the rejected writes (the floor source is
        // exercised by the restart test).
        recovery: Recovery {
            floor_source: false,
            recover_from: true,
        },
        ..Config::default()
    };

    let fenced = run(cfg.clone(), &target).await;
    let s = &fenced.summary;
    assert!(!s.timed_out, "time limit hit");
    assert!(s.attempts >= 2_000, "{s}");
    assert_eq!(s.violations, 0, "{s}");
    assert_eq!(s.lost_updates, 0, "{s}");
    assert_eq!(s.stale_reads, 0, "{s}");
    assert!(
        s.pauses > 20 && s.rejected > 0,
        "the stalls must cause rejections: {s}"
    );
    assert_eq!(s.audit_rows, s.rejected, "one audit row per rejection: {s}");
    assert_eq!(
        s.log_events, s.rejected,
        "one audit event per rejection: {s}"
    );
    assert_eq!(s.audit_failures, 0, "{s}");
    assert!(s.backend_kills > 0, "{s}");
    assert_failures_retryable(&fenced);
    // Liveness after the counter reset: every row accepted writes again, via recover_from.
    let reset = s
        .faults
        .iter()
        .find(|f| f.name == "counter_reset")
        .expect("the reset happened");
    assert_eq!(reset.rows_recovered, reset.rows, "{s}");
    assert!(s.counter_raises > 0, "{s}");
    // Every row's final value is its number of accepted writes (checked by the harness) and
    // those add up to what was accepted.
    let total: i64 =
        sqlx::query_scalar("SELECT sum(value)::bigint FROM pgfence_chaos.cell WHERE run = $1")
            .bind(&s.run)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(u64::try_from(total).unwrap(), s.accepted);

    // The control: the same run without fencing must be caught.
    let control = run(
        Config {
            mode: Mode::Unfenced,
            ..cfg
        },
        &target,
    )
    .await;
    let c = &control.summary;
    assert!(
        c.violations > 0,
        "the harness must detect unfenced overwrites: {c}"
    );
    assert!(
        c.lost_updates > 0,
        "the harness must detect lost updates: {c}"
    );
    assert_eq!(c.rejected, 0);
}

/// Idle expiry on (1 s) while leases run: 64 rows, 4 workers, so a row's counter expires
/// whenever the row sits idle past its last lease's TTL plus 1 s, while the other rows' leases
/// (and stalls past the TTL) go on. Fenced: no violation, no lost update, every rejection
/// audited; the expired counters were re-created above the marks (floor source) or healed
/// (`recover_from`). The same run unfenced: violations and lost updates.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn counters_expiring_idle_mid_run_are_safe_and_the_unfenced_control_breaks() {
    let db = TestDb::new().await;
    let target = Target {
        database: db.options.clone(),
        issuer_url: redis_url().await,
    };
    let cfg = Config {
        workers: 4,
        rows: 64,
        units: 2_000,
        idle_expiry: Some(Duration::from_secs(1)),
        pause_probability: 0.1,
        ..Config::default()
    };
    let fenced = run(cfg.clone(), &target).await;
    let s = &fenced.summary;
    assert!(!s.timed_out, "time limit hit");
    assert_eq!(s.violations, 0, "{s}");
    assert_eq!(s.lost_updates, 0, "{s}");
    assert_eq!(s.stale_reads, 0, "{s}");
    assert_eq!(s.audit_rows, s.rejected, "one audit row per rejection: {s}");
    assert_failures_retryable(&fenced);
    // Proof counters expired mid-run: re-created above the floor or raised after a refusal.
    let recreated = s.reseed_events.unwrap_or(0) + s.counter_raises;
    assert!(recreated > 0, "no counter expired during the run: {s}");
    let total: i64 =
        sqlx::query_scalar("SELECT sum(value)::bigint FROM pgfence_chaos.cell WHERE run = $1")
            .bind(&s.run)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(u64::try_from(total).unwrap(), s.accepted);

    let control = run(
        Config {
            mode: Mode::Unfenced,
            ..cfg
        },
        &target,
    )
    .await;
    let c = &control.summary;
    assert!(
        c.violations > 0,
        "the harness must detect unfenced overwrites: {c}"
    );
    assert!(
        c.lost_updates > 0,
        "the harness must detect lost updates: {c}"
    );
}

/// Restarting Redis (it comes back empty: counters and locks gone) mid-run. Safety holds;
/// the floor source reseeds the counters and every row writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_restart_mid_run_is_safe_and_recovers_by_itself() {
    let db = TestDb::new().await;
    let redis = Server::redis().await.expect("throwaway Redis");
    let target = Target {
        database: db.options.clone(),
        issuer_url: redis.url(),
    };
    let cfg = Config {
        units: 1_200,
        recovery: Recovery {
            floor_source: true,
            recover_from: true,
        },
        seed: 7,
        ..Config::default()
    };
    let (report, _redis) = run_with_restart(cfg, &target, redis, "redis_restart").await;
    let s = &report.summary;
    assert!(!s.timed_out, "{s}");
    assert!(s.is_safe(), "{s}");
    assert_eq!(s.audit_rows, s.rejected, "{s}");
    assert_eq!(s.log_events, s.rejected, "{s}");
    let f = s
        .faults
        .iter()
        .find(|f| f.name == "redis_restart")
        .expect("restart happened");
    assert_eq!(f.rows_recovered, f.rows, "writes resume on every row: {s}");
    assert!(f.recovery_ms.is_some());
    assert!(
        s.reseed_events.unwrap_or(0) > 0,
        "the floor source reseeded the lost counters: {s}"
    );
    assert_failures_retryable(&report);
}

/// Restarting Postgres mid-run (own server: the shared one must not go down under the other
/// tests). Safety holds, every error is typed and retryable, writes resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_restart_mid_run_is_safe_and_errors_are_retryable() {
    let pg = Server::postgres().await.expect("throwaway PostgreSQL");
    let target = Target {
        database: PgConnectOptions::from_str(&pg.url()).unwrap(),
        issuer_url: redis_url().await,
    };
    let cfg = Config {
        units: 1_200,
        seed: 11,
        ..Config::default()
    };
    let (report, _pg) = run_with_restart(cfg, &target, pg, "postgres_restart").await;
    let s = &report.summary;
    assert!(!s.timed_out, "{s}");
    assert!(s.is_safe(), "{s}");
    assert_failures_retryable(&report);
    // A rejection whose audit insert met the restart is reported as an audit failure event.
    let failures = s.audit_failures;
    assert!(s.audit_rows <= s.rejected, "{s}");
    assert!(s.audit_rows + failures >= s.rejected, "{s}");
    assert_eq!(s.log_events, s.rejected, "{s}");
    let f = s
        .faults
        .iter()
        .find(|f| f.name == "postgres_restart")
        .expect("restart happened");
    assert_eq!(f.rows_recovered, f.rows, "writes resume on every row: {s}");
}

/// The checks every safe multi-statement run must pass.
fn assert_session_run_safe(report: &Report) {
    let s = &report.summary;
    assert!(!s.timed_out, "time limit hit: {s}");
    assert_eq!(s.violations, 0, "{s}");
    assert_eq!(s.lost_updates, 0, "{s}");
    assert_eq!(s.stale_reads, 0, "{s}");
    assert!(s.rejected > 0, "the stalls must cause rejections: {s}");
    assert_eq!(s.audit_rows, s.rejected, "one audit row per rejection: {s}");
    assert_eq!(
        s.log_events, s.rejected,
        "one audit event per rejection: {s}"
    );
    assert_eq!(s.audit_failures, 0, "{s}");
    assert_failures_retryable(report);
}

/// Tries fenced out after an earlier transaction of the same try had committed: the lease
/// worked, stalled past its TTL between transactions, and a newer lease got in.
fn fenced_out_part_way(report: &Report, by: &str) -> usize {
    report
        .attempts
        .iter()
        .filter(|a| a.commits > 0)
        .filter(|a| matches!(&a.outcome, Outcome::Rejected { by: b, .. } if *b == by))
        .count()
}

/// The sum of the run's counter values.
async fn total(db: &TestDb, run: &str) -> u64 {
    let total: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(value), 0)::bigint FROM pgfence_chaos.cell WHERE run = $1",
    )
    .bind(run)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    u64::try_from(total).unwrap()
}

fn session_cfg(mode: Mode) -> Config {
    Config {
        mode,
        workers: 8,
        rows: 8,
        units: 2_000,
        reset_counters_at: vec![900],
        kill_every: Some(Duration::from_millis(150)),
        // Stall more often than the single-write runs: a unit has more places to stall in.
        pause_probability: 0.08,
        ..Config::default()
    }
}

/// Row claim: one lease claims its row (fence + read in one statement), then writes it 2–4
/// times over 1–3 transactions, with stalls past the TTL anywhere in between, a counter
/// reset and killed backends. No violation and no lost update; each unit's increment lands
/// at most once (its claim reads back whether it did), so the rows add up to the units that
/// incremented; every rejection is audited.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn row_claim_sessions_hold_under_faults() {
    let db = TestDb::new().await;
    let target = Target {
        database: db.options.clone(),
        issuer_url: redis_url().await,
    };
    let report = run(session_cfg(Mode::RowClaim), &target).await;
    assert_session_run_safe(&report);
    let s = &report.summary;
    assert_eq!(s.repeated_increments, 0, "{s}");
    assert_eq!(s.increments, s.units_incremented, "{s}");
    assert_eq!(total(&db, &s.run).await, s.units_incremented, "{s}");
    assert!(
        s.accepted > 2 * s.increments,
        "claims and rewrites are recorded besides the increments: {s}"
    );
    assert!(
        fenced_out_part_way(&report, "update") + fenced_out_part_way(&report, "claim") > 0,
        "some lease must be fenced out after a committed transaction: {s}"
    );
    let reset = s
        .faults
        .iter()
        .find(|f| f.name == "counter_reset")
        .expect("the reset happened");
    assert_eq!(reset.rows_recovered, reset.rows, "{s}");
}

/// Multi-transaction fenced work: one lease checks its resource first in each of 2–3
/// transactions and increments its row in each, under the same faults. No violation, no
/// lost update; the rows add up to the committed increments.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fenced_multi_sessions_hold_under_faults() {
    let db = TestDb::new().await;
    let target = Target {
        database: db.options.clone(),
        issuer_url: redis_url().await,
    };
    let report = run(session_cfg(Mode::FencedMulti), &target).await;
    assert_session_run_safe(&report);
    let s = &report.summary;
    assert_eq!(total(&db, &s.run).await, s.increments, "{s}");
    assert!(s.increments > 2 * s.units_incremented, "{s}");
    assert!(
        fenced_out_part_way(&report, "check") > 0,
        "some lease must fail its check after a committed transaction: {s}"
    );
    let reset = s
        .faults
        .iter()
        .find(|f| f.name == "counter_reset")
        .expect("the reset happened");
    assert_eq!(reset.rows_recovered, reset.rows, "{s}");
}

/// Lease-less writers next to the leases: row-claim's leases (stalls past the TTL, killed
/// backends) on 8 rows, with 2 lease-less writers writing random rows of them every 0–6 ms —
/// half `fence = fence + 1` (must be refused, `PF007`, every time), half audited bypasses by
/// an allowed role (applied, audited, the row sealed). No violation, no lost update of either
/// kind: the rows hold the leases' increments plus the bypasses'; the leases that had claimed
/// a row before a bypass were rejected as sealed instead of writing it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leaseless_writers_are_refused_or_sealed_and_nothing_is_lost() {
    let db = TestDb::new().await;
    let target = Target {
        database: db.options.clone(),
        issuer_url: redis_url().await,
    };
    let cfg = Config {
        mode: Mode::LeaselessMix,
        workers: 8,
        rows: 8,
        units: 600,
        kill_every: Some(Duration::from_millis(150)),
        pause_probability: 0.08,
        leaseless_writers: 2,
        leaseless_every: Duration::from_millis(3),
        seed: 67,
        ..Config::default()
    };
    let report = run(cfg, &target).await;
    let s = &report.summary;
    assert!(!s.timed_out, "time limit hit: {s}");
    assert_eq!(s.violations, 0, "{s}");
    assert_eq!(s.lost_updates, 0, "{s}");
    assert_eq!(s.stale_reads, 0, "{s}");
    let l = s.leaseless.as_ref().expect("lease-less figures");
    assert!(l.fence_plus_one_refused > 0, "some fence + 1 refused: {s}");
    assert_eq!(
        l.fence_plus_one_refused, l.fence_plus_one_refused_pf007,
        "every refusal of a fence + 1 is PF007 (LeaselessWrite): {s}"
    );
    assert_eq!(l.fence_plus_one_accepted, 0, "{s}");
    assert!(l.bypass_applied > 0, "some bypass applied: {s}");
    assert_eq!(l.bypass_refused, 0, "the bypass role is allowed: {s}");
    assert_eq!(
        l.bypass_audit_rows, l.bypass_committed,
        "one audit row per bypass: {s}"
    );
    assert!(
        l.leases_sealed > 0,
        "some lease must have claimed a row before a bypass and been sealed out: {s}"
    );
    assert_eq!(l.lost_lease_increments, 0, "{s}");
    assert_eq!(l.lost_bypass_increments, 0, "{s}");
    assert_eq!(l.sealed_writes, 0, "{s}");
    assert_eq!(l.ack_mismatches, 0, "{s}");
    // The rows hold every committed increment, the leases' and the bypasses'.
    assert_eq!(
        total(&db, &s.run).await,
        s.increments + l.bypass_committed,
        "{s}"
    );
    assert_eq!(s.repeated_increments, 0, "{s}");
    // Every lease rejection (sealed ones included) is audited and logged once.
    assert!(s.rejected >= l.leases_sealed, "{s}");
    assert_eq!(s.audit_rows, s.rejected, "one audit row per rejection: {s}");
    assert_eq!(s.log_events, s.rejected, "{s}");
    assert_eq!(s.audit_failures, 0, "{s}");
    assert_failures_retryable(&report);
    for w in &report.leaseless {
        if let LeaselessOutcome::Failed {
            retryable, error, ..
        } = &w.outcome
        {
            assert!(
                retryable,
                "non-retryable lease-less failure {error} in {w:?}"
            );
        }
    }
}

/// Row claim with `--coalesce`: the updates a unit makes alone in a transaction go through
/// one shared `pgfence::repository::Coalescer` (half the units give every update a transaction of its own),
/// so concurrent units' fenced updates of the table are sent as one statement, under stalls
/// past the TTL, a counter reset and killed backends. Each coalesced write's history row is
/// inserted by a trigger in the coalesced statement itself, so commit order, token order and
/// lost updates are checked exactly as for the writes in the units' own transactions: no
/// violation, no lost update, each unit's increment at most once, every rejection audited
/// once — and the coalescer really grouped writes. The same workload unfenced loses updates.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn row_claim_through_the_coalescer_holds_under_faults() {
    let db = TestDb::new().await;
    let target = Target {
        database: db.options.clone(),
        issuer_url: redis_url().await,
    };
    let cfg = Config {
        workers: 16,
        rows: 32,
        coalesce: true,
        seed: 71,
        ..session_cfg(Mode::RowClaim)
    };
    let report = run(cfg.clone(), &target).await;
    let s = &report.summary;
    assert!(!s.timed_out, "time limit hit: {s}");
    assert_eq!(s.violations, 0, "{s}");
    assert_eq!(s.lost_updates, 0, "{s}");
    assert_eq!(s.stale_reads, 0, "{s}");
    assert!(s.rejected > 0, "the stalls must cause rejections: {s}");
    assert_eq!(
        s.log_events, s.rejected,
        "one audit event per rejection: {s}"
    );
    // A rejection re-sent alone runs in the write's own gate, which writes its audit row and
    // then commits; a backend killed during that COMMIT takes the row with it, and the library
    // writes it again through the auditor's pool: one row per rejection, or (when that write
    // fails too) a reported audit failure.
    assert!(
        s.audit_rows <= s.rejected && s.audit_rows + s.audit_failures >= s.rejected,
        "one audit row or audit failure per rejection: {s}"
    );
    assert_failures_retryable(&report);
    assert_eq!(s.repeated_increments, 0, "{s}");
    assert_eq!(s.increments, s.units_incremented, "{s}");
    assert_eq!(total(&db, &s.run).await, s.units_incremented, "{s}");
    let c = s.coalescer.as_ref().expect("coalescer figures");
    assert!(c.statements > 0, "some updates must have queued up: {s}");
    // A statement carries whatever waited when the lane came free: one update at times, more
    // on average when updates queue up.
    assert!(
        c.carried > c.statements,
        "coalesced statements carry more than one update on average: {s}"
    );
    assert!(c.applied > 0, "{s}");
    // The coalesced writes are in the history (the trigger's rows), checked with the rest.
    let coalesced_rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pgfence_chaos.history WHERE run = $1 AND coalesced",
    )
    .bind(&s.run)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(coalesced_rows > 0, "{s}");
    let reset = s
        .faults
        .iter()
        .find(|f| f.name == "counter_reset")
        .expect("the reset happened");
    assert_eq!(reset.rows_recovered, reset.rows, "{s}");

    // Lease-less writers on the same rows: the coalesced updates of a lease whose row a bypass
    // sealed are refused (RowSealed, sent again alone and audited there), nothing is lost.
    let mixed = run(
        Config {
            mode: Mode::LeaselessMix,
            units: 600,
            leaseless_writers: 2,
            leaseless_every: Duration::from_millis(3),
            reset_counters_at: Vec::new(),
            seed: 73,
            ..cfg.clone()
        },
        &target,
    )
    .await;
    let m = &mixed.summary;
    assert!(!m.timed_out, "time limit hit: {m}");
    assert!(m.is_safe(), "{m}");
    let l = m.leaseless.as_ref().expect("lease-less figures");
    assert_eq!(l.lost_lease_increments + l.lost_bypass_increments, 0, "{m}");
    assert_eq!(l.sealed_writes, 0, "{m}");
    assert_eq!(l.ack_mismatches, 0, "{m}");
    assert_eq!(
        total(&db, &m.run).await,
        m.increments + l.bypass_committed,
        "{m}"
    );
    assert!(
        m.audit_rows <= m.rejected && m.audit_rows + m.audit_failures >= m.rejected,
        "{m}"
    );
    assert!(
        m.coalescer.as_ref().is_some_and(|c| c.statements > 0),
        "{m}"
    );

    // The control: the same workload without fencing loses updates.
    let control = run(
        Config {
            mode: Mode::Unfenced,
            units: 600,
            coalesce: false,
            ..cfg
        },
        &target,
    )
    .await;
    let c = &control.summary;
    assert!(c.lost_updates > 0, "the workload must break unfenced: {c}");
}

/// `coalesce` with a mode whose write must share a transaction with what orders it (the
/// fenced modes' `Fence::check`, the effects ledger's finish) or that has nothing to coalesce
/// is refused before anything is set up, with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesce_is_refused_where_the_write_must_share_a_transaction() {
    let db = TestDb::new().await;
    let target = Target {
        database: db.options.clone(),
        issuer_url: redis_url().await,
    };
    for (mode, says) in [
        (Mode::Fenced, "Fence::check"),
        (Mode::FencedMulti, "Fence::check"),
        (Mode::Batch, "update_many"),
        (Mode::Effects, "finish"),
        (Mode::Unfenced, "nothing fences"),
    ] {
        let refused = Harness::new(
            Config {
                mode,
                coalesce: true,
                ..Config::default()
            },
            &target,
        )
        .await
        .err()
        .unwrap_or_else(|| panic!("{mode} with coalesce must be refused"));
        assert!(
            matches!(&refused, ChaosError::Config(m) if m.contains(says)),
            "{mode}: {refused}"
        );
    }
    // Nothing was set up: the refusal came before the harness's schema.
    let schema: Option<String> = sqlx::query_scalar(
        "SELECT nspname::text FROM pg_catalog.pg_namespace WHERE nspname = 'pgfence_chaos'",
    )
    .fetch_optional(&db.pool)
    .await
    .unwrap();
    assert_eq!(schema, None);
}

/// A CI-sized batch run: 96 rows in 2 groups (one lock and token counter each), 600 units of
/// 10–48 rows, stalls past the TTL, a counter reset and killed backends.
fn batch_cfg() -> Config {
    Config {
        mode: Mode::Batch,
        workers: 8,
        rows: 96,
        batch_groups: 2,
        units: 600,
        reset_counters_at: vec![250],
        kill_every: Some(Duration::from_millis(150)),
        pause_probability: 0.1,
        ..Config::default()
    }
}

/// The batch run's per-row checks beyond the session ones: the rows add up to the committed
/// increments (each unit's increment of a row lands at most once), the rejections are rows,
/// and every rejected row has exactly one audit row naming it (operation, lease token, row).
async fn assert_batch_rows(report: &Report, pool: &sqlx::PgPool) {
    let s = &report.summary;
    let b = s.batch.as_ref().expect("batch figures");
    assert_eq!(s.repeated_increments, 0, "{s}");
    assert_eq!(
        b.rows_rejected_at_claim + b.rows_rejected_at_write,
        s.rejected
    );
    // What the workers saw, row by row, against pgfence.audit row by row.
    let mut seen: BTreeMap<(String, i64, i32), i64> = BTreeMap::new();
    for a in &report.attempts {
        let batch = a.batch.as_ref().expect("every batch try records its rows");
        for (op, results) in [("claim", &batch.claim), ("update", &batch.write)] {
            for (row, r) in batch.rows.iter().zip(results) {
                if r.is_rejection() {
                    *seen.entry((op.to_owned(), a.token, *row)).or_default() += 1;
                }
            }
        }
    }
    let audited: BTreeMap<(String, i64, i32), i64> = sqlx::query_as::<_, (String, i64, i32, i64)>(
        "SELECT operation, presented, (row_key::jsonb ->> 1)::int, count(*) FROM pgfence.audit \
         WHERE left(resource, length($1)) = $1 GROUP BY 1, 2, 3",
    )
    .bind(format!("chaos:{}:", s.run))
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(op, presented, row, n)| ((op, presented, row), n))
    .collect();
    assert_eq!(seen, audited, "one audit row per rejected row: {s}");
}

/// Batch: one lease per group of rows claims 10–48 of them in one statement (`claim_many`),
/// then writes value + 1 to the claimed ones in one statement (`update_many`), in one or two
/// transactions, with stalls past the TTL, a counter reset and killed backends. Per row: tokens
/// in order, no lost update, the rows add up to the committed increments; every rejected row
/// is audited and logged once; zombies' batches come out mixed (some rows applied, some
/// stale); writes resume on every row after the reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batch_units_hold_under_faults() {
    let db = TestDb::new().await;
    let target = Target {
        database: db.options.clone(),
        issuer_url: redis_url().await,
    };
    let report = run(batch_cfg(), &target).await;
    assert_session_run_safe(&report);
    assert_batch_rows(&report, &db.pool).await;
    let s = &report.summary;
    let b = s.batch.as_ref().expect("batch figures");
    assert!(b.min_rows >= 10 && b.max_rows <= 48, "{s}");
    assert_eq!(total(&db, &s.run).await, s.increments, "{s}");
    assert!(s.increments > 10 * s.units_incremented, "{s}");
    assert!(s.backend_kills > 0, "{s}");
    assert!(
        b.mixed_claims + b.mixed_writes > 0,
        "some batch must have had both applied and stale rows: {s}"
    );
    let reset = s
        .faults
        .iter()
        .find(|f| f.name == "counter_reset")
        .expect("the reset happened");
    assert_eq!(reset.rows_recovered, reset.rows, "{s}");
    assert!(s.counter_raises > 0, "{s}");
}

/// Batch mode through a Redis restart (counters and locks gone: no check marks for the floor
/// source, so `recover_from` on the first rejected rows) and a Postgres restart (own server).
/// Safety holds, every error is retryable, writes resume on every row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batch_survives_redis_and_postgres_restarts() {
    let cfg = Config {
        units: 650,
        reset_counters_at: Vec::new(),
        seed: 29,
        ..batch_cfg()
    };
    let db = TestDb::new().await;
    let redis = Server::redis().await.expect("throwaway Redis");
    let target = Target {
        database: db.options.clone(),
        issuer_url: redis.url(),
    };
    let (report, redis) = run_with_restart(cfg.clone(), &target, redis, "redis_restart").await;
    redis.stop();
    assert_session_run_safe(&report);
    assert_batch_rows(&report, &db.pool).await;
    let s = &report.summary;
    let f = s
        .faults
        .iter()
        .find(|f| f.name == "redis_restart")
        .expect("restart happened");
    assert_eq!(f.rows_recovered, f.rows, "writes resume on every row: {s}");

    let pg = Server::postgres().await.expect("throwaway PostgreSQL");
    let target = Target {
        database: PgConnectOptions::from_str(&pg.url()).unwrap(),
        issuer_url: redis_url().await,
    };
    let (report, _pg) =
        run_with_restart(Config { seed: 31, ..cfg }, &target, pg, "postgres_restart").await;
    let s = &report.summary;
    assert!(!s.timed_out, "{s}");
    assert!(s.is_safe(), "{s}");
    assert_failures_retryable(&report);
    assert!(s.audit_rows <= s.rejected, "{s}");
    assert!(s.audit_rows + s.audit_failures >= s.rejected, "{s}");
    assert_eq!(s.log_events, s.rejected, "{s}");
    let f = s
        .faults
        .iter()
        .find(|f| f.name == "postgres_restart")
        .expect("restart happened");
    assert_eq!(f.rows_recovered, f.rows, "writes resume on every row: {s}");
}

/// Both session modes through a Redis restart (counters and locks gone). Row claims leave no
/// resource high-water mark for the floor source, so they recover through `recover_from`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn session_modes_survive_a_redis_restart() {
    let db = TestDb::new().await;
    for (mode, seed) in [(Mode::RowClaim, 13), (Mode::FencedMulti, 17)] {
        let redis = Server::redis().await.expect("throwaway Redis");
        let target = Target {
            database: db.options.clone(),
            issuer_url: redis.url(),
        };
        let cfg = Config {
            mode,
            units: 1_200,
            seed,
            ..Config::default()
        };
        let (report, redis) = run_with_restart(cfg, &target, redis, "redis_restart").await;
        assert_session_run_safe(&report);
        let s = &report.summary;
        let f = s
            .faults
            .iter()
            .find(|f| f.name == "redis_restart")
            .expect("restart happened");
        assert_eq!(f.rows_recovered, f.rows, "writes resume on every row: {s}");
        redis.stop();
    }
}

/// Both session modes through a Postgres restart (own server). Safety holds, every error is
/// retryable, writes resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn session_modes_survive_a_postgres_restart() {
    let mut pg = Server::postgres().await.expect("throwaway PostgreSQL");
    for (mode, seed) in [(Mode::RowClaim, 19), (Mode::FencedMulti, 23)] {
        let target = Target {
            database: PgConnectOptions::from_str(&pg.url()).unwrap(),
            issuer_url: redis_url().await,
        };
        let cfg = Config {
            mode,
            units: 1_200,
            seed,
            ..Config::default()
        };
        let report;
        (report, pg) = run_with_restart(cfg, &target, pg, "postgres_restart").await;
        let s = &report.summary;
        assert!(!s.timed_out, "{s}");
        assert!(s.is_safe(), "{s}");
        assert_failures_retryable(&report);
        assert!(s.audit_rows <= s.rejected, "{s}");
        assert!(s.audit_rows + s.audit_failures >= s.rejected, "{s}");
        assert_eq!(s.log_events, s.rejected, "{s}");
        let f = s
            .faults
            .iter()
            .find(|f| f.name == "postgres_restart")
            .expect("restart happened");
        assert_eq!(f.rows_recovered, f.rows, "writes resume on every row: {s}");
    }
}

// ---------------------------------------------------------------------------------------------
// Real issuer failovers: the leader (etcd, ZooKeeper) or the master (Redis Sentinel) is killed
// mid-run and the run goes on against the survivors.

/// Runs the harness against `deployment` (started for a failover) and fails it over once `at`
/// units have started (`lag`: Redis, units the replica misses before). Returns the report,
/// what the failover did, and the deployment, which must outlive the run.
async fn run_with_failover(
    cfg: Config,
    db: &TestDb,
    mut deployment: Deployment,
    at: u64,
    lag: u64,
) -> (Report, FailoverEvent, Deployment) {
    let target = Target {
        database: db.options.clone(),
        issuer_url: deployment.url(),
    };
    let mut harness = Harness::new(cfg, &target).await.expect("harness setup");
    if harness.issuer_kind().can_reseed() {
        harness = harness
            .with_reseed_counter(ReseedCounter::install_global().expect("reseed counter"))
            .expect("a Redis run counts reseeds");
    }
    let ctl = harness.control();
    let failover = tokio::spawn(async move {
        let event = deployment.failover_at(&ctl, at, lag).await;
        (event, deployment)
    });
    let report = harness.run().await.expect("run");
    let (event, deployment) = failover.await.expect("failover task");
    eprintln!("{}{}", report.summary, report.summary.json());
    let event = event
        .expect("the failover goes through")
        .expect("the failover happened before the run ended");
    (report, event, deployment)
}

/// What every failover run must show: safe, every rejection reported, the leader changed,
/// writes accepted after it on every row, every failure retryable.
fn assert_failover_safe<'a>(report: &'a Report, event: &FailoverEvent) -> &'a FailoverFigures {
    let s = &report.summary;
    assert!(!s.timed_out, "time limit hit: {s}");
    assert_eq!(s.violations, 0, "{s}");
    assert_eq!(s.lost_updates, 0, "{s}");
    assert_eq!(s.stale_reads, 0, "{s}");
    assert_eq!(s.audit_rows, s.rejected, "one audit row per rejection: {s}");
    assert_eq!(
        s.log_events, s.rejected,
        "one audit event per rejection: {s}"
    );
    assert_eq!(s.audit_failures, 0, "{s}");
    assert_failures_retryable(report);
    let f = s.failover.as_ref().expect("failover figures");
    let new_leader = event.new_leader.as_deref().expect("a new leader");
    assert_ne!(new_leader, event.old_leader, "the leader changed: {s}");
    assert_eq!(f.old_leader, event.old_leader);
    assert!(f.leases_before > 0 && f.leases_after > 0, "{s}");
    assert!(
        f.units_accepted_after > 0 && f.accepted_after > 0,
        "writes accepted after the failover: {s}"
    );
    assert_eq!(f.rows_recovered, f.rows, "writes resume on every row: {s}");
    assert!(f.recovery_ms.is_some(), "{s}");
    f
}

/// The checks of a failover run on an issuer whose tokens never go backwards (etcd,
/// ZooKeeper): every token issued after the kill is above every token accepted before it.
fn assert_tokens_kept_rising(report: &Report, f: &FailoverFigures) {
    let s = &report.summary;
    assert_eq!(f.tokens_increased, Some(true), "{s}");
    assert!(f.min_token_after > f.max_token_before, "{s}");
    assert_eq!(f.resources_backwards, 0, "{s}");
    assert_eq!(f.duplicates_after, 0, "{s}");
    assert_eq!(s.counter_raises, 0, "nothing to recover: {s}");
    assert_eq!(s.reseed_events, None, "{s}");
    assert!(s.rejected > 0, "the stalls must cause rejections: {s}");
}

/// etcd, three members: the leader is killed (SIGKILL) at unit 200 of 400 while stalls past
/// the TTL and killed backends go on. Fenced mode: no violation, no lost update, every
/// rejection audited; tokens (revisions) issued after the kill are above every token accepted
/// before; every row writes again. The Redis-only settings are refused, not ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_leader_failover_mid_run_is_safe() {
    let Some(_etcd) = needs::<optional::Etcd>("etcd_leader_failover_mid_run_is_safe") else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(120), async {
        let db = TestDb::new().await;
        let deployment = Deployment::start(IssuerKind::Etcd, true)
            .await
            .expect("three etcd members");
        assert!(deployment.can_fail_over());
        let target = Target {
            database: db.options.clone(),
            issuer_url: deployment.url(),
        };
        // Counter resets and reseed counting are Redis's: refused with a clear error.
        let refused = Harness::new(
            Config {
                reset_counters_at: vec![10],
                ..Config::for_issuer(IssuerKind::Etcd)
            },
            &target,
        )
        .await
        .err()
        .expect("a counter reset with etcd is refused");
        assert!(
            matches!(&refused, ChaosError::Config(m) if m.contains("etcd")),
            "{refused}"
        );
        let harness = Harness::new(Config::for_issuer(IssuerKind::Etcd), &target)
            .await
            .unwrap();
        assert_eq!(harness.issuer_kind(), IssuerKind::Etcd);
        let refused = harness
            .with_reseed_counter(ReseedCounter::install_global().unwrap())
            .err()
            .expect("etcd never reseeds");
        assert!(matches!(refused, ChaosError::Config(_)), "{refused}");

        let cfg = Config {
            units: 400,
            kill_every: Some(Duration::from_millis(150)),
            seed: 41,
            ..Config::for_issuer(IssuerKind::Etcd)
        };
        let (report, event, _cluster) = run_with_failover(cfg, &db, deployment, 200, 0).await;
        let f = assert_failover_safe(&report, &event);
        assert_tokens_kept_rising(&report, f);
        assert_eq!(report.summary.issuer, "etcd");
    })
    .await
    .expect("the etcd failover run is bounded to 120 s");
}

/// ZooKeeper, an ensemble of three: the leader is killed at unit 600 of 1,200, in row-claim
/// mode (claim, then 2–4 fenced updates over 1–3 transactions per lease) with stalls past the
/// TTL and killed backends. Safe, audited, zxids keep rising across the new epoch, every row
/// writes again; each unit's increment lands at most once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn zookeeper_leader_failover_mid_run_is_safe() {
    let Some(_zk) = needs::<optional::ZooKeeper>("zookeeper_leader_failover_mid_run_is_safe")
    else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(120), async {
        let db = TestDb::new().await;
        let deployment = Deployment::start(IssuerKind::ZooKeeper, true)
            .await
            .expect("a ZooKeeper ensemble of three");
        let cfg = Config {
            mode: Mode::RowClaim,
            units: 1_200,
            pause_probability: 0.08,
            kill_every: Some(Duration::from_millis(150)),
            seed: 43,
            ..Config::for_issuer(IssuerKind::ZooKeeper)
        };
        let (report, event, _ensemble) = run_with_failover(cfg, &db, deployment, 600, 0).await;
        let f = assert_failover_safe(&report, &event);
        assert_tokens_kept_rising(&report, f);
        let s = &report.summary;
        assert_eq!(s.issuer, "zk");
        assert_eq!(s.repeated_increments, 0, "{s}");
        assert_eq!(total(&db, &s.run).await, s.units_incremented, "{s}");
        // A new leader starts a new epoch: the zxids after it are above 2^32 times it.
        let epoch = |t: i64| t >> 32;
        assert!(
            epoch(f.min_token_after.unwrap()) > epoch(f.max_token_before.unwrap()),
            "{s}"
        );
    })
    .await
    .expect("the ZooKeeper failover run is bounded to 120 s");
}

/// Redis Sentinel (a master, one replica, three sentinels): the replica is paused and cut off
/// 300 units before the master is killed at unit 900 of 1,400; the sentinels promote it with
/// counters that are behind, so tokens Postgres has seen are issued again. In fenced and in
/// row-claim mode: every such write is rejected (stale or duplicate token) and none accepted
/// (no violation, no lost update), every rejection audited, and `recover_from` (with the floor
/// source) brings every row back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_sentinel_failover_mid_run_is_safe_and_recovers() {
    let Some(_sentinel) =
        needs::<optional::Sentinel>("redis_sentinel_failover_mid_run_is_safe_and_recovers")
    else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(150), async {
        let db = TestDb::new().await;
        for (mode, seed) in [(Mode::Fenced, 47), (Mode::RowClaim, 53)] {
            let deployment = Deployment::start(IssuerKind::Redis, true)
                .await
                .expect("master, replica and sentinels");
            assert!(deployment.url().starts_with("redis+sentinel://"));
            let cfg = Config {
                mode,
                units: 1_400,
                kill_every: Some(Duration::from_millis(150)),
                seed,
                ..Config::for_issuer(IssuerKind::Redis)
            };
            let (report, event, sentinels) =
                run_with_failover(cfg, &db, deployment, 900, 300).await;
            let f = assert_failover_safe(&report, &event);
            let s = &report.summary;
            assert_eq!(s.issuer, "redis");
            assert_eq!(
                f.replica_paused_at_unit.map(|u| u >= 600),
                Some(true),
                "{s}"
            );
            assert!(
                f.resources_backwards > 0 && f.tokens_increased != Some(true),
                "the promoted replica re-issued tokens Postgres had seen: {s}"
            );
            assert!(f.rejected_after > 0, "those writes were rejected: {s}");
            assert!(
                s.counter_raises > 0,
                "recover_from raised the counters: {s}"
            );
            sentinels.stop();
        }
    })
    .await
    .expect("the Redis failover runs are bounded to 150 s");
}

// ---------------------------------------------------------------------------------------------
// The PostgreSQL issuer: leases and tokens in the harness's own database, so its faults are the
// database's — restarts take the issuer down with the workers, and killed backends include the
// issuer's.

/// Runs the harness on the PostgreSQL issuer and restarts `server` (the harness's database,
/// the issuer's too) once each of `at` units have started, proving each restart by the
/// postmaster's start time. Returns the report and the server, which must outlive the run.
async fn run_pg_issuer_with_restarts(
    cfg: Config,
    target: &Target,
    mut server: Server,
    at: &'static [u64],
) -> (Report, Server) {
    let harness = Harness::new(cfg, target).await.expect("harness setup");
    assert_eq!(harness.issuer_kind(), IssuerKind::Postgres);
    let ctl = harness.control();
    let restarts = tokio::spawn(async move {
        let mut starts = vec![server_start(&server).await];
        for &unit in at {
            if !ctl.wait_for_units(unit).await {
                break;
            }
            ctl.mark_fault("postgres_restart");
            server.restart().await.expect("the server comes back");
            starts.push(server_start(&server).await);
        }
        (server, starts)
    });
    let report = harness.run().await.expect("run");
    let (server, starts) = restarts.await.unwrap();
    eprintln!("{}{}", report.summary, report.summary.json());
    // Proof the restarts happened: each time a new postmaster. (Workers need not see an
    // error: a restart can fall entirely between their statements.)
    assert_eq!(
        starts.len(),
        at.len() + 1,
        "the run ended before every restart"
    );
    for pair in starts.windows(2) {
        assert_ne!(pair[0], pair[1], "a restart did not happen: {starts:?}");
    }
    (report, server)
}

/// Per row (group in batch mode), every lease asked for after each fault got a higher token
/// than every lease granted before it: the issuer's counter survived the restart.
fn assert_tokens_rise_across_faults(report: &Report) {
    let s = &report.summary;
    for fault in &report.faults {
        let mut before: BTreeMap<i32, i64> = BTreeMap::new();
        let mut after: BTreeMap<i32, i64> = BTreeMap::new();
        for l in &report.leases {
            if l.at_ms < fault.at_ms {
                let max = before.entry(l.row).or_insert(l.token);
                *max = (*max).max(l.token);
            } else if l.asked_at_ms > fault.at_ms {
                let min = after.entry(l.row).or_insert(l.token);
                *min = (*min).min(l.token);
            }
        }
        assert!(!before.is_empty() && !after.is_empty(), "{s}");
        for (row, min_after) in &after {
            if let Some(max_before) = before.get(row) {
                assert!(
                    min_after > max_before,
                    "row {row}: token {min_after} after the {} at {} ms, {max_before} before: {s}",
                    fault.name,
                    fault.at_ms
                );
            }
        }
    }
}

/// The issuer's counter rows (`pgfence.issuer_counter`) of the run's resources are at or
/// above every token a lease of the run was granted.
async fn assert_issuer_counters_cover_leases(report: &Report, database_url: &str) {
    let s = &report.summary;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(database_url)
        .await
        .unwrap();
    let prefix = format!("chaos:{}:", s.run);
    let counters: BTreeMap<String, i64> = sqlx::query_as::<_, (String, i64)>(
        "SELECT counter, value FROM pgfence.issuer_counter \
          WHERE prefix = 'pgfence' AND left(counter, length($1)) = $1",
    )
    .bind(&prefix)
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    pool.close().await;
    let resource = |row: i32| match s.mode {
        Mode::Batch => format!("{prefix}group{row}"),
        _ => format!("{prefix}{row}"),
    };
    for l in &report.leases {
        let counter = counters.get(&resource(l.row)).copied();
        assert!(
            counter >= Some(l.token),
            "lease {l:?}: the issuer's counter is {counter:?}: {s}"
        );
    }
}

/// The PostgreSQL issuer on the harness's own (throwaway) database, which restarts twice (at
/// units 400 and 800 of 1,200) while a worker backend and one of the issuer's backends are
/// killed about every 150 ms, with stalls past the TTL; in fenced and in row-claim mode. No
/// violation, no lost update; every failure retryable; tokens keep rising across each restart
/// (the counter is a row in the same database) and the issuer's counter rows cover every
/// lease; every row writes again after each restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_issuer_survives_restarts_and_killed_backends() {
    tokio::time::timeout(Duration::from_secs(120), async {
        let mut pg = Server::postgres().await.expect("throwaway PostgreSQL");
        let target = Target::postgres(&pg.url()).unwrap();
        assert_eq!(target.issuer_url, pg.url(), "no other server");
        let mut mid_statement = 0;
        for (mode, seed) in [(Mode::Fenced, 59), (Mode::RowClaim, 61)] {
            let cfg = Config {
                mode,
                units: 1_200,
                kill_every: Some(Duration::from_millis(150)),
                seed,
                ..Config::for_issuer(IssuerKind::Postgres)
            };
            let report;
            (report, pg) = run_pg_issuer_with_restarts(cfg, &target, pg, &[400, 800]).await;
            let s = &report.summary;
            assert_eq!(s.issuer, "postgres");
            assert!(!s.timed_out, "{s}");
            assert_eq!(s.violations, 0, "{s}");
            assert_eq!(s.lost_updates, 0, "{s}");
            assert_eq!(s.stale_reads, 0, "{s}");
            assert!(s.rejected > 0, "the stalls must cause rejections: {s}");
            assert_failures_retryable(&report);
            // A rejection whose audit insert met a restart is reported as an audit failure.
            assert!(s.audit_rows <= s.rejected, "{s}");
            assert!(s.audit_rows + s.audit_failures >= s.rejected, "{s}");
            assert_eq!(s.log_events, s.rejected, "{s}");
            // Nothing to reseed or recover: the counter never went backwards.
            assert_eq!(s.counter_raises, 0, "{s}");
            assert_eq!(s.reseed_events, None, "{s}");
            assert!(s.backend_kills > s.issuer_backend_kills, "{s}");
            assert!(
                s.issuer_backend_kills > 0,
                "the issuer's backends are killed too: {s}"
            );
            mid_statement += s.issuer_kills_mid_statement;
            let restarts: Vec<_> = s
                .faults
                .iter()
                .filter(|f| f.name == "postgres_restart")
                .collect();
            assert_eq!(restarts.len(), 2, "{s}");
            for f in restarts {
                assert_eq!(f.rows_recovered, f.rows, "writes resume on every row: {s}");
            }
            assert_tokens_rise_across_faults(&report);
            assert_issuer_counters_cover_leases(&report, &pg.url()).await;
            if mode == Mode::RowClaim {
                assert_eq!(s.repeated_increments, 0, "{s}");
                assert_eq!(s.increments, s.units_incremented, "{s}");
            }
        }
        assert!(
            mid_statement > 0,
            "some issuer backend was killed running an acquire or release"
        );
    })
    .await
    .expect("the PostgreSQL issuer runs are bounded to 120 s");
}

/// The unfenced control on the PostgreSQL issuer, with stalls past the TTL and killed worker
/// and issuer backends: the harness catches its overwrites and lost updates (so the protected
/// runs' zeros mean something). Batch mode (48 rows in 2 groups, 300 units of 10–24 rows)
/// under the same faults: none, every rejected row audited.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_issuer_batch_holds_and_the_unfenced_control_loses_updates() {
    let db = TestDb::new().await;
    let target = Target::postgres(&db.url()).unwrap();
    let cfg = Config {
        workers: 8,
        rows: 8,
        units: 2_000,
        kill_every: Some(Duration::from_millis(150)),
        ..Config::for_issuer(IssuerKind::Postgres)
    };
    let control = Harness::new(
        Config {
            mode: Mode::Unfenced,
            ..cfg.clone()
        },
        &target,
    )
    .await
    .expect("harness setup")
    .run()
    .await
    .expect("run");
    let c = &control.summary;
    eprintln!("{c}{}", c.json());
    assert_eq!(c.issuer, "postgres");
    assert!(!c.timed_out, "{c}");
    assert!(
        c.violations > 0,
        "the harness must detect unfenced overwrites: {c}"
    );
    assert!(
        c.lost_updates > 0,
        "the harness must detect lost updates: {c}"
    );
    assert_eq!(c.rejected, 0, "{c}");
    assert!(c.issuer_backend_kills > 0, "{c}");

    let timing = Config::for_issuer(IssuerKind::Postgres);
    let batch = Harness::new(
        Config {
            ttl: timing.ttl,
            pause_min: timing.pause_min,
            pause_max: timing.pause_max,
            acquire_wait: timing.acquire_wait,
            rows: 48,
            units: 300,
            reset_counters_at: Vec::new(),
            seed: 67,
            ..batch_cfg()
        },
        &target,
    )
    .await
    .expect("harness setup")
    .run()
    .await
    .expect("run");
    eprintln!("{}{}", batch.summary, batch.summary.json());
    assert_session_run_safe(&batch);
    assert_batch_rows(&batch, &db.pool).await;
    let s = &batch.summary;
    assert_eq!(s.issuer, "postgres");
    assert_eq!(total(&db, &s.run).await, s.increments, "{s}");
    assert!(s.issuer_backend_kills > 0, "{s}");
}

/// The Redis-only faults and settings are refused for the PostgreSQL issuer with a clear error,
/// not ignored: by the library (counter resets, reseed counting, a throwaway issuer
/// deployment, a non-PostgreSQL URL for `Target::postgres`) and by the binary (also
/// `--failover-at`, which has no issuer leader to kill, and `--pg-failover-at` on a
/// configured database, which cannot be failed over), before any server starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_issuer_refuses_redis_only_faults() {
    let db = TestDb::new().await;
    let target = Target::postgres(&db.url()).unwrap();
    let refused = Harness::new(
        Config {
            reset_counters_at: vec![10],
            ..Config::for_issuer(IssuerKind::Postgres)
        },
        &target,
    )
    .await
    .err()
    .expect("a counter reset with the postgres issuer is refused");
    assert!(
        matches!(&refused, ChaosError::Config(m) if m.contains("postgres")),
        "{refused}"
    );
    let harness = Harness::new(Config::for_issuer(IssuerKind::Postgres), &target)
        .await
        .unwrap();
    assert_eq!(harness.issuer_kind(), IssuerKind::Postgres);
    let refused = harness
        .with_reseed_counter(ReseedCounter::install_global().unwrap())
        .err()
        .expect("the postgres issuer never reseeds");
    assert!(
        matches!(&refused, ChaosError::Config(m) if m.contains("postgres")),
        "{refused}"
    );
    let refused = Deployment::start(IssuerKind::Postgres, false)
        .await
        .expect_err("no servers of its own");
    assert!(matches!(refused, ChaosError::Config(_)), "{refused}");
    assert!(matches!(
        Target::postgres("redis://127.0.0.1:6379"),
        Err(ChaosError::Config(_))
    ));

    // The binary refuses them before it starts anything.
    let url = db.url();
    let cases: [(&[&str], &str); 9] = [
        (
            &["--reset-counter-at", "10"],
            "--reset-counter-at deletes Redis counter keys",
        ),
        (
            &["--restart-redis-at", "10"],
            "--restart-redis-at restarts the throwaway Redis",
        ),
        (
            &["--no-floor-source"],
            "--no-floor-source and --no-recover-from are Redis settings",
        ),
        (
            &["--no-recover-from"],
            "--no-floor-source and --no-recover-from are Redis settings",
        ),
        (
            &["--failover-at", "10"],
            "fail the database over with --pg-failover-at",
        ),
        (
            &["--pg-failover-at", "5"],
            "needs its own throwaway primary and standby: drop --database-url",
        ),
        (
            &["--redis-url", "redis://127.0.0.1:1"],
            "--redis-url is for --issuer redis",
        ),
        (
            &["--issuer-url", "postgres://postgres@127.0.0.1:1/other"],
            "the postgres issuer runs on the harness's own database",
        ),
        (
            &["--issuer-url", "redis://127.0.0.1:1"],
            "--issuer postgres, but --issuer-url is a redis URL",
        ),
    ];
    for (extra, expected) in cases {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgfence-chaos"))
            .args([
                "--issuer",
                "postgres",
                "--database-url",
                &url,
                "--attempts",
                "10",
            ])
            .args(extra)
            .env_remove("DATABASE_URL")
            .env_remove("PGFENCE_ISSUER_URL")
            .env_remove("REDIS_URL")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} was accepted: {stderr}");
        assert!(stderr.contains(expected), "{extra:?}: {stderr}");
        assert!(
            out.stdout.is_empty(),
            "{extra:?} ran: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Side effects outside PostgreSQL: the effects modes charge each row's invoices at a real HTTP
// payment provider on loopback (one per run), through the effect ledger.

/// A CI-sized effects run: 8 workers on 8 rows (each a sequence of invoices), 1,000 units,
/// stalls past the TTL (mostly between the ledger's begin and the provider call), a backend
/// killed about every 150 ms.
fn effects_cfg(mode: Mode) -> Config {
    Config {
        mode,
        workers: 8,
        rows: 8,
        units: 1_000,
        kill_every: Some(Duration::from_millis(150)),
        pause_probability: 0.08,
        ..Config::default()
    }
}

/// The database side of an effects run (keyed or not): fenced like `row-claim`, so no
/// violation and no lost update; each invoice paid once per unit; every rejection audited
/// (across a database restart, an audit insert may fail instead: it is then reported).
async fn assert_effects_db_safe(report: &Report, pool: &sqlx::PgPool, restarted: bool) {
    let s = &report.summary;
    assert!(!s.timed_out, "time limit hit: {s}");
    assert_eq!(s.violations, 0, "{s}");
    assert_eq!(s.lost_updates, 0, "{s}");
    assert_eq!(s.stale_reads, 0, "{s}");
    assert!(s.rejected > 0, "the stalls must cause rejections: {s}");
    assert_eq!(
        s.log_events, s.rejected,
        "one audit event per rejection: {s}"
    );
    if restarted {
        assert!(s.audit_rows <= s.rejected, "{s}");
        assert!(s.audit_rows + s.audit_failures >= s.rejected, "{s}");
    } else {
        assert_eq!(s.audit_rows, s.rejected, "one audit row per rejection: {s}");
        assert_eq!(s.audit_failures, 0, "{s}");
    }
    assert_failures_retryable(report);
    assert_eq!(s.repeated_increments, 0, "{s}");
    assert_eq!(s.increments, s.units_incremented, "{s}");
    assert_eq!(total_on(pool, &s.run).await, s.increments, "{s}");
    assert!(s.backend_kills > 0, "{s}");
    let e = s.effects.as_ref().expect("effect figures");
    assert_eq!(
        e.invoices_paid, s.increments,
        "one invoice paid per increment: {s}"
    );
    assert_eq!(e.items_succeeded, e.invoices_paid, "the ledger agrees: {s}");
    assert_eq!(e.paid_uncharged, 0, "every paid invoice was charged: {s}");
    assert_eq!(e.stray_charges, 0, "{s}");
    assert!(e.stalls_before_call > 0, "{s}");
    assert!(
        e.takeovers > 0,
        "some item must be taken over after a stall: {s}"
    );
    // Every answered call was a request the provider counted (one without an answer may
    // not have reached it).
    assert!(e.provider_requests <= e.calls, "{s}");
    assert!(e.calls - e.calls_failed <= e.provider_requests, "{s}");
}

/// The sum of the run's counter values on `pool`.
async fn total_on(pool: &sqlx::PgPool, run: &str) -> u64 {
    let total: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(value), 0)::bigint FROM pgfence_chaos.cell WHERE run = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    u64::try_from(total).unwrap()
}

/// Tries refused by the effect ledger (its begin or its finish).
fn refused_by_ledger(report: &Report) -> usize {
    report
        .attempts
        .iter()
        .filter(|a| {
            matches!(&a.outcome, Outcome::Rejected { by, .. } if *by == "effect" || *by == "effect_finish")
        })
        .count()
}

/// The effects job with the ledger's idempotency keys, under stalls past the TTL and killed
/// backends: no invoice charged twice at the provider (counted there), every paid invoice
/// charged, items taken over by newer holders, zombies' late calls deduplicated by the key
/// (replayed, or refused as in flight), zombies refused by the ledger; no violation or lost
/// update in the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_charge_each_invoice_once_under_stalls_and_killed_backends() {
    let db = TestDb::new().await;
    let target = Target {
        database: db.options.clone(),
        issuer_url: redis_url().await,
    };
    let report = run(effects_cfg(Mode::Effects), &target).await;
    assert_effects_db_safe(&report, &db.pool, false).await;
    let s = &report.summary;
    let e = s.effects.as_ref().unwrap();
    assert_eq!(e.keys, "ledger");
    assert_eq!(e.duplicate_effects, 0, "an invoice was charged twice: {s}");
    assert_eq!(e.extra_charges, 0, "{s}");
    assert!(e.exactly_once(), "{s}");
    // Each item charged at most once: the paid ones, and any left charged but unrecorded.
    assert_eq!(
        e.provider_charges,
        e.invoices_paid + e.charged_unpaid,
        "{s}"
    );
    assert!(
        e.late_calls_deduplicated > 0,
        "some zombie must call late and be deduplicated: {s}"
    );
    assert_eq!(
        e.late_calls_charged + e.late_calls_deduplicated,
        e.late_calls,
        "{s}"
    );
    assert!(e.provider_replays + e.provider_conflicts > 0, "{s}");
    assert_eq!(
        e.calls_conflict, e.provider_conflicts,
        "each 409 seen by a worker: {s}"
    );
    assert!(
        refused_by_ledger(&report) > 0,
        "some zombie must be refused by the ledger: {s}"
    );
}

/// The control: the same job with a key per lease (`<item>-<token>`). The database side
/// stays safe, but the zombies' late calls charge again: invoices charged twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_unkeyed_control_charges_invoices_twice() {
    let db = TestDb::new().await;
    let target = Target {
        database: db.options.clone(),
        issuer_url: redis_url().await,
    };
    let report = run(effects_cfg(Mode::EffectsUnkeyed), &target).await;
    assert_effects_db_safe(&report, &db.pool, false).await;
    let s = &report.summary;
    let e = s.effects.as_ref().unwrap();
    assert_eq!(e.keys, "per-lease");
    assert!(
        e.duplicate_effects > 0,
        "the harness must catch invoices charged twice: {s}"
    );
    assert!(!e.exactly_once(), "{s}");
    assert!(e.extra_charges >= e.duplicate_effects, "{s}");
    assert!(e.late_calls_charged > 0, "{s}");
    // No two leases share a key; a late call can still be a replay when it is the same
    // lease's retry (after a killed backend) of a call it had made before the takeover.
    assert!(
        e.late_calls_deduplicated * 4 < e.late_calls_charged,
        "the control's late calls mostly charge again: {s}"
    );
    assert!(
        e.provider_charges > e.invoices_paid + e.charged_unpaid,
        "{s}"
    );
}

/// The effects job on the PostgreSQL issuer, through a restart of the database (the issuer's
/// too) at unit 400 of 1,000 and killed worker and issuer backends: no invoice charged twice,
/// no violation or lost update, every row paying invoices again after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_issuer_effects_charge_once_across_a_restart() {
    tokio::time::timeout(Duration::from_secs(90), async {
        let pg = Server::postgres().await.expect("throwaway PostgreSQL");
        let target = Target::postgres(&pg.url()).unwrap();
        let cfg = Config {
            seed: 71,
            ..effects_cfg(Mode::Effects)
        };
        let (report, pg) = run_pg_issuer_with_restarts(cfg, &target, pg, &[400]).await;
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect(&pg.url())
            .await
            .unwrap();
        assert_effects_db_safe(&report, &pool, true).await;
        pool.close().await;
        let s = &report.summary;
        assert_eq!(s.issuer, "postgres");
        assert!(s.issuer_backend_kills > 0, "{s}");
        let e = s.effects.as_ref().unwrap();
        assert!(e.exactly_once(), "{s}");
        assert_eq!(e.duplicate_effects, 0, "{s}");
        assert!(e.provider_replays + e.provider_conflicts > 0, "{s}");
        let restart = s
            .faults
            .iter()
            .find(|f| f.name == "postgres_restart")
            .expect("the restart happened");
        assert_eq!(restart.rows_recovered, restart.rows, "{s}");
    })
    .await
    .expect("the run is bounded to 90 s");
}

// ---------------------------------------------------------------------------------------------
// Why the harness's fenced mode checks in a transaction: the row fence alone keeps tokens in
// order but cannot make read-modify-write atomic.

#[derive(Debug, Clone)]
struct CounterRow {
    id: i32,
    value: i64,
}

pgfence::fenced_table!(CounterRow { table: "counter", key: id: i32, columns: [value] });

async fn counter_db() -> (TestDb, Fence, Repository<CounterRow>) {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE counter (id int PRIMARY KEY, value bigint NOT NULL); INSERT INTO counter VALUES (1, 0);")
        .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("counter").unwrap())
        .await
        .unwrap();
    let fence = Fence::new(db.pool.clone());
    let repo = Repository::<CounterRow>::with_auditor(fence.auditor().clone()).unwrap();
    (db, fence, repo)
}

async fn value(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT value FROM counter WHERE id = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_fence_alone_loses_an_increment_and_the_transaction_check_does_not() {
    let issuer = support::issuer().await;
    let ttl = Duration::from_millis(50);

    // Row fence only. A (older token) read 0 and stalled past its TTL; B took the lock with a
    // newer token and read 0; A wakes up and writes 1 before B writes; B writes 1. Both writes
    // are accepted and in token order — and A's increment is lost.
    let (db, _fence, repo) = counter_db().await;
    let resource = unique_resource("rmw");
    let a = issuer.acquire(&resource, ttl).await.unwrap().unwrap();
    let a_read = value(&db).await;
    tokio::time::sleep(ttl * 2).await; // A stalls; its lease expires
    let b = issuer.acquire(&resource, ttl).await.unwrap().unwrap();
    assert!(b.token() > a.token());
    let b_read = value(&db).await;
    repo.update(
        &db.pool,
        &a,
        &CounterRow {
            id: 1,
            value: a_read + 1,
        },
    )
    .await
    .expect("the row fence accepts A: nobody newer has written yet");
    repo.update(
        &db.pool,
        &b,
        &CounterRow {
            id: 1,
            value: b_read + 1,
        },
    )
    .await
    .expect("and B: its token is newer than A's");
    assert_eq!(value(&db).await, 1, "two accepted increments, one survives");

    // The same interleaving under the transaction-scope check. A checks, reads and stalls
    // inside its transaction; B's check waits for A's transaction, then reads A's write.
    let (db, fence, repo) = counter_db().await;
    let resource = unique_resource("rmw");
    let a = issuer.acquire(&resource, ttl).await.unwrap().unwrap();
    let mut a_tx = db.pool.begin().await.unwrap();
    fence.check(&mut *a_tx, &resource, &a).await.unwrap();
    let a_read: i64 = sqlx::query_scalar("SELECT value FROM counter WHERE id = 1")
        .fetch_one(&mut *a_tx)
        .await
        .unwrap();
    tokio::time::sleep(ttl * 2).await;
    let b = issuer.acquire(&resource, ttl).await.unwrap().unwrap();
    let b_task = {
        let (pool, fence, repo, resource) = (
            db.pool.clone(),
            fence.clone(),
            repo.clone(),
            resource.clone(),
        );
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            fence.check(&mut *tx, &resource, &b).await?;
            let read: i64 = sqlx::query_scalar("SELECT value FROM counter WHERE id = 1")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            repo.update(
                &mut *tx,
                &b,
                &CounterRow {
                    id: 1,
                    value: read + 1,
                },
            )
            .await?;
            tx.commit().await?;
            Ok::<i64, Error>(read)
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!b_task.is_finished(), "B's check waits for A's transaction");
    repo.update(
        &mut *a_tx,
        &a,
        &CounterRow {
            id: 1,
            value: a_read + 1,
        },
    )
    .await
    .unwrap();
    a_tx.commit().await.unwrap();
    assert_eq!(b_task.await.unwrap().unwrap(), 1, "B read A's increment");
    assert_eq!(value(&db).await, 2, "no lost update");

    // And when the stalled holder had not checked yet, it is the one rejected.
    let (db, fence, repo) = counter_db().await;
    let resource = unique_resource("rmw");
    let a = issuer.acquire(&resource, ttl).await.unwrap().unwrap();
    tokio::time::sleep(ttl * 2).await;
    let b = issuer.acquire(&resource, ttl).await.unwrap().unwrap();
    let mut b_tx = db.pool.begin().await.unwrap();
    fence.check(&mut *b_tx, &resource, &b).await.unwrap();
    let read: i64 = sqlx::query_scalar("SELECT value FROM counter WHERE id = 1")
        .fetch_one(&mut *b_tx)
        .await
        .unwrap();
    repo.update(
        &mut *b_tx,
        &b,
        &CounterRow {
            id: 1,
            value: read + 1,
        },
    )
    .await
    .unwrap();
    b_tx.commit().await.unwrap();
    let mut a_tx = db.pool.begin().await.unwrap();
    let err = fence.check(&mut *a_tx, &resource, &a).await.unwrap_err();
    assert!(err.is_stale() && !err.is_retryable(), "{err:?}");
    assert_eq!(value(&db).await, 1);
}

// ---------------------------------------------------------------------------------------------
// Error classification: a killed connection is retryable, a stale token is not, and multi-row
// work under the check is all-or-nothing.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_connection_is_retryable_stale_is_not_and_work_is_all_or_nothing() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE ledger (batch int NOT NULL, line int NOT NULL, amount bigint NOT NULL, PRIMARY KEY (batch, line))")
        .await;
    let victim = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options.clone().application_name("chaos-victim"))
        .await
        .unwrap();
    let fence = Fence::new(db.pool.clone());
    let resource = Resource::new("ledger:batch:7").unwrap();

    // Multi-row work under the check; the backend dies before COMMIT.
    let mut tx = victim.begin().await.unwrap();
    fence
        .check(&mut *tx, &resource, support::token(10))
        .await
        .unwrap();
    for line in 0..3 {
        sqlx::query("INSERT INTO ledger VALUES (7, $1, 100)")
            .bind(line)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    let killed: bool = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'chaos-victim'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(killed);
    let err = Error::from(
        sqlx::query("INSERT INTO ledger VALUES (7, 3, 100)")
            .execute(&mut *tx)
            .await
            .expect_err("the connection is gone"),
    );
    eprintln!("killed connection surfaced as: {err:?}");
    assert!(
        matches!(&err, Error::Backend(b) if b.kind() == pgfence::error::BackendKind::Database),
        "{err:?}"
    );
    assert!(
        err.is_retryable(),
        "a killed connection is safe to retry: {err:?}"
    );
    drop(tx);

    // Nothing of the transaction survived: no ledger line, no high-water mark.
    let lines: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(lines, 0, "all or nothing");
    assert_eq!(fence.high_water(&resource).await.unwrap(), 0);

    // The retry, as is_retryable() allows, applies the whole batch exactly once.
    let mut tx = victim.begin().await.unwrap();
    fence
        .check(&mut *tx, &resource, support::token(10))
        .await
        .unwrap();
    for line in 0..4 {
        sqlx::query("INSERT INTO ledger VALUES (7, $1, 100)")
            .bind(line)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    // Once a newer lease has checked, the old token is stale, and stale is never retryable.
    fence
        .check(&db.pool, &resource, support::token(11))
        .await
        .unwrap();
    let mut tx = victim.begin().await.unwrap();
    let err = fence
        .check(&mut *tx, &resource, support::token(10))
        .await
        .unwrap_err();
    support::assert_stale(&err, 10, 11);
    assert!(!err.is_retryable());
    drop(tx);
    let lines: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(lines, 4);

    // A Redis server that went away is a retryable error too.
    let redis = Server::redis().await.unwrap();
    let issuer = RedisIssuer::connect(&redis.url()).await.unwrap();
    redis.stop();
    let err = issuer
        .acquire(&unique_resource("gone"), Duration::from_secs(1))
        .await
        .expect_err("no Redis");
    eprintln!("Redis gone surfaced as: {err:?}");
    assert!(
        matches!(&err, Error::Backend(b) if b.kind() == pgfence::error::BackendKind::Redis)
            && err.is_retryable(),
        "{err:?}"
    );
}

/// An audited bypass (`UPDATE counter SET value = value + 1` after `pgfence.bypass(reason)`)
/// in one transaction.
async fn bypass_increment(db: &TestDb) {
    let mut tx = db.pool.begin().await.unwrap();
    pgfence::guard::bypass(&mut tx, "chaos test").await.unwrap();
    sqlx::query("UPDATE counter SET value = value + 1 WHERE id = 1")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// What leaseless mode relies on, deterministically: a bypass seals the row against the lease
/// that *claimed* it before (its claim wrote the fence), which then gets `RowSealed` instead
/// of writing back what it read before the bypass, and `fence = fence + 1` is refused. A lease
/// that only *read* the row (no claim: it has not written it) is not sealed out, and its write
/// overwrites the bypass: the harness's leaseless mode uses claims for that reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bypass_seals_out_the_lease_that_claimed_the_row_not_one_that_only_read_it() {
    let issuer = support::issuer().await;
    let ttl = Duration::from_secs(5);
    let (db, _fence, repo) = counter_db().await;
    let me: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    pgfence::guard::allow_bypass(&db.pool, &me).await.unwrap();

    // The lease-less `fence + 1` is refused.
    let raw = sqlx::query("UPDATE counter SET value = value + 1, fence = fence + 1 WHERE id = 1")
        .execute(&db.pool)
        .await
        .map_err(Error::from);
    assert!(matches!(raw, Err(Error::LeaselessWrite { .. })), "{raw:?}");

    // A claims the row (reads 0), a bypass adds 1, A's write of 0 + 1 is refused as sealed.
    let resource = unique_resource("sealed");
    let a = issuer.acquire(&resource, ttl).await.unwrap().unwrap();
    let (_, a_read): (i32, i64) = repo.claim(&db.pool, &a, &1).await.unwrap();
    bypass_increment(&db).await;
    let sealed = repo
        .update(
            &db.pool,
            &a,
            &CounterRow {
                id: 1,
                value: a_read + 1,
            },
        )
        .await;
    assert!(matches!(sealed, Err(Error::RowSealed { .. })), "{sealed:?}");
    assert_eq!(value(&db).await, 1, "the bypass's increment is kept");
    issuer.release(&a).await.unwrap();

    // B, a newer lease, only reads the row (1); a bypass adds 1; B's write of 1 + 1 goes
    // through (B never wrote the row, so the seal does not name it): the bypass is lost.
    let b = issuer.acquire(&resource, ttl).await.unwrap().unwrap();
    let b_read = value(&db).await;
    bypass_increment(&db).await;
    repo.update(
        &db.pool,
        &b,
        &CounterRow {
            id: 1,
            value: b_read + 1,
        },
    )
    .await
    .expect("a lease that did not write the row before the bypass is not sealed out");
    assert_eq!(value(&db).await, 2, "three increments committed, two kept");
}

// ---------------------------------------------------------------------------------------------
// A failover of the harness's own PostgreSQL (issue 23): an asynchronous standby, cut off while
// the workers write on, promoted after the primary is killed, behind the same address.

/// Runs the harness on a fresh asynchronous primary/standby pair and fails it over at unit
/// `at` (cut-off, 300 ms of writes, kill, promotion). Returns the report.
async fn run_with_pg_failover(cfg: Config, at: u64, issuer_url: Option<String>) -> Report {
    let mut set = PgReplicaSet::start(Replication::Async)
        .await
        .expect("throwaway primary and standby");
    let target = match issuer_url {
        Some(issuer_url) => Target {
            database: PgConnectOptions::from_str(&set.url()).unwrap(),
            issuer_url,
        },
        None => Target::postgres(&set.url()).unwrap(),
    };
    let mut harness = Harness::new(cfg, &target).await.expect("harness setup");
    if harness.issuer_kind().can_reseed() {
        harness = harness
            .with_reseed_counter(ReseedCounter::install_global().expect("reseed counter"))
            .expect("a Redis run counts reseeds");
    }
    let ctl = harness.control();
    let failover = tokio::spawn(async move {
        let event = pg_failover_at(&mut set, &ctl, at, Duration::from_millis(300)).await;
        (event, set)
    });
    let report = harness.run().await.expect("run");
    let (event, set) = failover.await.expect("failover task");
    eprintln!("{}{}", report.summary, report.summary.json());
    let event = event
        .expect("the failover goes through")
        .expect("the failover happened before the run ended");
    assert_eq!(event.new_timeline, event.old_timeline + 1);
    assert!(event.cut_off_at_ms < event.kill_at_ms && event.kill_at_ms < event.promoted_at_ms);
    set.stop();
    report
}

/// What every database failover run must show among the writes the new primary kept: no
/// violation (token order, acknowledgement mismatch, torn write, zombie write), no lost update,
/// no stale read; every rejection reported (audit rows missing only for rejections the
/// promotion may have lost); every row writing again; every failure retryable.
fn assert_pg_failover_safe(report: &Report) -> &PgFailoverFigures {
    let s = &report.summary;
    assert!(!s.timed_out, "time limit hit: {s}");
    let p = s.pg_failover.as_ref().expect("database failover figures");
    assert_eq!(
        p.zombie_writes, 0,
        "a lease from before the promotion wrote after it: {s}"
    );
    assert_eq!(s.violations, 0, "{s}");
    assert_eq!(s.lost_updates, 0, "{s}");
    assert_eq!(s.stale_reads, 0, "{s}");
    assert_eq!(
        s.log_events, s.rejected,
        "one audit event per rejection: {s}"
    );
    assert!(s.audit_rows <= s.rejected, "{s}");
    assert!(p.rejections_reported(), "{s}");
    assert_eq!(p.rows_recovered, p.rows, "every row writes again: {s}");
    assert!(p.recovery_ms.is_some(), "{s}");
    assert_eq!(s.faults.len(), 1, "{s}");
    assert_eq!(s.faults[0].name, "pg_failover");
    p
}

/// Fenced mode, 8 workers, 600 units, the database failed over at unit 300: the promotion
/// loses acknowledged writes (the database's loss, counted apart), nothing unsafe among the
/// writes the new primary kept, and the leases from before the promotion that came back
/// after it are refused with `FencedByFailover` — on 0.2's code they got back in (zombie
/// writes, the control this test was written against).
///
/// Whether a lease from before the kill tries again after it depends on where the workers'
/// stalls fall, so a run where none did proves nothing about zombies: it is still checked for
/// safety, and the scenario runs again with the next seed (at most three runs). With seed 61
/// alone, one of three full test runs on a 2-core machine had no lease cross.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_failover_loses_writes_but_lets_no_zombie_back_in() {
    tokio::time::timeout(Duration::from_secs(300), async {
        let mut runs = Vec::new();
        for seed in [61, 71, 83] {
            let cfg = Config {
                workers: 8,
                rows: 4,
                units: 600,
                outage_retry: Some(Duration::from_secs(10)),
                // More leases stalled inside their transaction when the primary dies.
                pause_probability: 0.2,
                seed,
                ..Config::default()
            };
            let report = run_with_pg_failover(cfg, 300, Some(redis_url().await)).await;
            let s = &report.summary;
            let p = assert_pg_failover_safe(&report);
            assert!(!p.issuer_rolled_back, "{s}");
            runs.push((seed, p.leases_across));
            if p.leases_across == 0 {
                eprintln!("seed {seed}: no lease from before the kill came back; next seed");
                continue;
            }
            assert!(
                p.acknowledged_lost >= 1 && p.units_lost >= 1,
                "the promotion lost acknowledged writes: {s}"
            );
            assert!(
                p.fenced_by_failover >= 1 && p.leases_fenced >= 1,
                "fencing refused the leases from before the promotion: {s}"
            );
            assert!(p.first_refusal_ms.is_some(), "{s}");
            let refused = report
                .attempts
                .iter()
                .filter(|a| matches!(a.outcome, Outcome::Rejected { failover: true, .. }))
                .count();
            assert_eq!(pgfence_chaos_count(refused), p.fenced_by_failover);
            return;
        }
        panic!("no run had a lease from before the kill come back (seed, leases): {runs:?}");
    })
    .await
    .expect("the database failover runs are bounded to 300 s");
}

/// The PostgreSQL issuer on the failed-over database: its counters roll back with the
/// database (the report says so), and still nothing unsafe gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_failover_with_the_postgres_issuer_rolls_its_counters_back_safely() {
    tokio::time::timeout(Duration::from_secs(120), async {
        let cfg = Config {
            workers: 8,
            rows: 4,
            units: 600,
            outage_retry: Some(Duration::from_secs(10)),
            seed: 67,
            ..Config::for_issuer(IssuerKind::Postgres)
        };
        let report = run_with_pg_failover(cfg, 300, None).await;
        let s = &report.summary;
        assert_eq!(s.issuer, "postgres");
        let p = assert_pg_failover_safe(&report);
        assert!(p.issuer_rolled_back, "{s}");
        assert!(
            p.acknowledged_lost >= 1,
            "the promotion lost acknowledged writes: {s}"
        );
    })
    .await
    .expect("the database failover run is bounded to 120 s");
}

fn pgfence_chaos_count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}
