//! Jepsen's nemeses in the harness: network partitions between groups of workers and
//! PostgreSQL (black-holes and resets through the testkit's proxy), and steps of the lock
//! server's wall clock (a redis-server under the testkit's wall-clock shim). Each runs fenced
//! (no violation, no lost update) and unfenced (the control: the same nemesis must break it).
//! The partition run also writes its history as JSON lines, parsed back here.

use pgfence_test_support as support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use pgfence_chaos::{
    Config, Harness, Mode, Outcome, Partitions, Report, SteppableClock, Target, clock_steps,
};
use pgfence_testkit::ServerError;
use pgfence_testkit::clock::{ShimmedPostgres, ShimmedRedis};
use serde_json::Value;
use support::{TestDb, redis_url};

/// `PGFENCE_NEMESIS_UNITS` overrides a run's units (and lifts its time limit to 20 minutes),
/// for the longer runs of docs/proof.md; `PGFENCE_NEMESIS_HISTORY` keeps the partition run's
/// history file at that path.
fn units(default: u64) -> (u64, Duration) {
    match std::env::var("PGFENCE_NEMESIS_UNITS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(n) => (n, Duration::from_secs(1_200)),
        None => (default, Duration::from_secs(40)),
    }
}

async fn run(cfg: Config, target: &Target) -> Report {
    let harness = Harness::new(cfg, target).await.expect("harness setup");
    let report = harness.run().await.expect("run");
    eprintln!("{}{}", report.summary, report.summary.json());
    report
}

/// Parses a history file and checks it against the report: one `invoke` and one `complete`
/// per attempt, outcomes as the report counts them, one `final` per row, every `invoke`
/// before its `complete`, and the nemesis actions.
fn check_history(path: &std::path::Path, report: &Report) {
    let text = std::fs::read_to_string(path).expect("history file");
    let events: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(events[0]["type"], "run");
    assert_eq!(events[0]["format"], 1);
    assert_eq!(events[0]["run"], report.summary.run.as_str());
    let mut kinds: BTreeMap<String, u64> = BTreeMap::new();
    let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
    let mut open: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    let mut last_time = 0;
    for e in &events[1..] {
        let kind = e["type"].as_str().expect("type").to_owned();
        *kinds.entry(kind.clone()).or_default() += 1;
        if kind == "final" {
            continue;
        }
        let t = e["time_ms"].as_u64().expect("time_ms");
        assert!(t >= last_time, "events in time order: {e}");
        last_time = t;
        let key = || (e["lease"].as_u64().unwrap(), e["try"].as_u64().unwrap());
        match kind.as_str() {
            "invoke" => {
                assert!(open.insert(key(), t).is_none(), "one invoke per try: {e}");
            }
            "complete" => {
                assert!(open.remove(&key()).is_some(), "complete after invoke: {e}");
                *outcomes
                    .entry(e["outcome"].as_str().unwrap().to_owned())
                    .or_default() += 1;
            }
            _ => {}
        }
    }
    assert!(open.is_empty(), "every invoke completes");
    check_call_bounds(&events);
    let s = &report.summary;
    let attempts = s.attempts;
    assert_eq!(kinds.get("invoke").copied().unwrap_or(0), attempts);
    assert_eq!(kinds.get("complete").copied().unwrap_or(0), attempts);
    assert_eq!(kinds.get("final").copied().unwrap_or(0), s.rows as u64);
    let n = |k: &str| outcomes.get(k).copied().unwrap_or(0);
    let ok = report
        .attempts
        .iter()
        .filter(|a| a.outcome == Outcome::Accepted)
        .count() as u64;
    assert_eq!(n("ok"), ok);
    assert_eq!(n("ok"), s.acknowledged);
    assert_eq!(n("stale"), s.rejected);
    assert_eq!(n("unknown") + n("error"), s.errors);
    assert_eq!(
        kinds.get("nemesis").copied().unwrap_or(0),
        report.nemesis.len() as u64
    );
    // The final values add up to the accepted increments (each fenced write adds one).
    let total: i64 = events
        .iter()
        .filter(|e| e["type"] == "final")
        .map(|e| e["value"].as_i64().unwrap())
        .sum();
    assert_eq!(u64::try_from(total).unwrap(), s.accepted);
}

/// What a library call may take past its bound (scheduling on a loaded machine).
const CALL_SLACK_MS: u64 = 500;

/// "No library call in the partition tests outlives its bound": every `call` line of the
/// history (issuer `acquire_wait` and `release`, repository `update`) took at most its
/// `bound_ms` plus [`CALL_SLACK_MS`]. Prints the longest of each kind against its bound.
fn check_call_bounds(events: &[Value]) {
    // op -> (calls, longest in µs, its bound in ms)
    let mut longest: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
    for e in events.iter().filter(|e| e["type"] == "call") {
        let op = e["op"].as_str().expect("op").to_owned();
        let took = e["duration_us"].as_u64().expect("duration_us");
        let bound = e["bound_ms"].as_u64().expect("bound_ms");
        assert!(
            took <= (bound + CALL_SLACK_MS) * 1000,
            "a library call outlived its bound ({bound} ms + {CALL_SLACK_MS} ms): {e}"
        );
        let entry = longest.entry(op).or_default();
        entry.0 += 1;
        if took >= entry.1 {
            (entry.1, entry.2) = (took, bound);
        }
    }
    for op in ["acquire_wait", "release", "update"] {
        assert!(longest.contains_key(op), "no {op} call in the history");
    }
    for (op, (calls, took, bound)) in &longest {
        eprintln!(
            "library calls: {op}: {calls} calls, longest {:.1} ms (bound {bound} ms)",
            *took as f64 / 1000.0
        );
    }
}

/// Partitions between two groups of 4 workers and PostgreSQL, one group at a time: black-holes
/// of 100–250 ms (bytes wait, connections stay open; 40 % of them one way only: requests, or
/// PostgreSQL's replies) and resets (every connection of
/// the group closed), about every 150 ms, with no injected stall: a worker cut off while it
/// holds a 40 ms lease is the zombie. Fenced: safe; the history file matches the report. The
/// unfenced control under the same partitions: lost updates.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitions_fenced_holds_and_the_unfenced_control_breaks() {
    let db = TestDb::new().await;
    let target = Target {
        database: db.options.clone(),
        issuer_url: redis_url().await,
    };
    let dir = std::env::temp_dir().join(format!("pgfence-nemesis-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let history = std::env::var_os("PGFENCE_NEMESIS_HISTORY")
        .map_or_else(|| dir.join("partitions.jsonl"), std::path::PathBuf::from);
    let (units, max_duration) = units(500);
    let cfg = Config {
        workers: 8,
        rows: 4,
        units,
        pause_probability: 0.0,
        max_duration,
        partitions: Some(Partitions {
            groups: 2,
            every: Duration::from_millis(150),
            black_hole_min: Duration::from_millis(100),
            black_hole_max: Duration::from_millis(250),
            reset_share: 0.3,
            one_way_share: 0.4,
        }),
        history: Some(history.clone()),
        ..Config::default()
    };

    let fenced = run(cfg.clone(), &target).await;
    let s = &fenced.summary;
    assert!(!s.timed_out, "time limit hit: {s}");
    assert_eq!(s.violations, 0, "{s}");
    assert_eq!(s.lost_updates, 0, "{s}");
    assert_eq!(s.stale_reads, 0, "{s}");
    let n = s.nemesis.as_ref().expect("nemesis figures");
    assert!(n.black_holes > 0 && n.resets > 0, "{s}");
    assert!(
        n.one_way > 0 && n.one_way < n.black_holes,
        "both two-way and one-way black-holes: {s}"
    );
    assert!(
        s.rejected > 0,
        "partitions past the TTL must cause rejections: {s}"
    );
    assert_eq!(s.audit_rows, s.rejected, "{s}");
    check_history(&history, &fenced);

    let control = run(
        Config {
            mode: Mode::Unfenced,
            history: None,
            ..cfg
        },
        &target,
    )
    .await;
    let c = &control.summary;
    assert!(c.nemesis.as_ref().is_some_and(|n| n.black_holes > 0), "{c}");
    assert!(
        c.lost_updates > 0,
        "partitions must break the unfenced control: {c}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The lock server's clock stepped forward by 5 s about every 300 ms: Redis expires every
/// lock at once, and the next worker is granted a lock whose holder still believes it holds it
/// (1 s leases, in-lease work of 100–300 ms: no lease runs out by itself). Fenced: safe. The
/// unfenced control under the same steps: lost updates. Skips without a C compiler or Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clock_steps_fenced_holds_and_the_unfenced_control_breaks() {
    let redis = match ShimmedRedis::start().await {
        Ok(r) => Arc::new(r),
        Err(e @ ServerError::NotInstalled { .. }) => {
            eprintln!("skipped: {e}");
            return;
        }
        Err(e) => panic!("shimmed redis: {e}"),
    };
    let db = TestDb::new().await;
    let target = Target {
        database: db.options.clone(),
        issuer_url: redis.url(),
    };
    let (units, max_duration) = units(200);
    let cfg = Config {
        workers: 8,
        rows: 4,
        units,
        ttl: Duration::from_secs(1),
        acquire_wait: Duration::from_secs(3),
        pause_probability: 1.0,
        pause_min: Duration::from_millis(100),
        pause_max: Duration::from_millis(300),
        max_duration,
        ..Config::default()
    };
    let run_stepped = |cfg: Config| {
        let redis = redis.clone();
        let target = target.clone();
        async move {
            let harness = Harness::new(cfg, &target).await.expect("harness setup");
            let clock: Arc<dyn SteppableClock> = redis;
            let steps = tokio::spawn(clock_steps(
                harness.control(),
                clock,
                10,
                Duration::from_millis(300),
                5_000,
                7,
            ));
            let report = harness.run().await.expect("run");
            let steps = steps.await.unwrap();
            eprintln!("{}{}", report.summary, report.summary.json());
            (report, steps)
        }
    };

    let (fenced, steps) = run_stepped(cfg.clone()).await;
    let s = &fenced.summary;
    assert!(steps > 0, "the clock was stepped");
    assert!(!s.timed_out, "time limit hit: {s}");
    assert_eq!(s.violations, 0, "{s}");
    assert_eq!(s.lost_updates, 0, "{s}");
    assert_eq!(s.stale_reads, 0, "{s}");
    assert!(
        s.nemesis.as_ref().is_some_and(|n| n.clock_steps == steps),
        "{s}"
    );
    assert!(s.rejected > 0, "early grants must cause rejections: {s}");

    let (control, steps) = run_stepped(Config {
        mode: Mode::Unfenced,
        ..cfg
    })
    .await;
    let c = &control.summary;
    assert!(steps > 0);
    assert!(
        c.lost_updates > 0,
        "clock steps must break the unfenced control: {c}"
    );
}

/// The PostgreSQL issuer (`PgIssuer`: leases expire by the database's clock) on a throwaway
/// PostgreSQL under the wall-clock shim, stepped forward by 5 s about every 300 ms: a lock is
/// granted again while its holder, by its own clock, still holds it. The same server is the
/// protected database (its fences compare tokens, no clock). Fenced: safe. The unfenced
/// control: lost updates. Skips without a C compiler or the PostgreSQL server.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_issuer_clock_steps_fenced_holds_and_the_unfenced_control_breaks() {
    let pg = match ShimmedPostgres::start().await {
        Ok(p) => Arc::new(p),
        Err(e @ ServerError::NotInstalled { .. }) => {
            eprintln!("skipped: {e}");
            return;
        }
        Err(e) => panic!("shimmed postgres: {e}"),
    };
    let options: sqlx::postgres::PgConnectOptions = pg.url().parse().unwrap();
    let target = Target {
        database: options,
        issuer_url: pg.url(),
    };
    let (units, max_duration) = units(120);
    let cfg = Config {
        workers: 8,
        rows: 4,
        units,
        ttl: Duration::from_secs(1),
        acquire_wait: Duration::from_secs(3),
        pause_probability: 1.0,
        pause_min: Duration::from_millis(100),
        pause_max: Duration::from_millis(300),
        max_duration,
        ..Config::default()
    };
    let run_stepped = |cfg: Config| {
        let pg = pg.clone();
        let target = target.clone();
        async move {
            let harness = Harness::new(cfg, &target).await.expect("harness setup");
            let clock: Arc<dyn SteppableClock> = pg;
            let steps = tokio::spawn(clock_steps(
                harness.control(),
                clock,
                10,
                Duration::from_millis(300),
                5_000,
                11,
            ));
            let report = harness.run().await.expect("run");
            let steps = steps.await.unwrap();
            eprintln!("{}{}", report.summary, report.summary.json());
            (report, steps)
        }
    };

    let (fenced, steps) = run_stepped(cfg.clone()).await;
    let s = &fenced.summary;
    assert_eq!(s.issuer, "postgres", "{s}");
    assert!(steps > 0, "the clock was stepped");
    assert!(!s.timed_out, "time limit hit: {s}");
    assert_eq!(s.violations, 0, "{s}");
    assert_eq!(s.lost_updates, 0, "{s}");
    assert_eq!(s.stale_reads, 0, "{s}");
    assert!(s.rejected > 0, "early grants must cause rejections: {s}");

    let (control, steps) = run_stepped(Config {
        mode: Mode::Unfenced,
        ..cfg
    })
    .await;
    let c = &control.summary;
    assert!(steps > 0);
    assert!(
        c.lost_updates > 0,
        "clock steps must break the unfenced control: {c}"
    );
}

/// The shim moves only the server's wall clock, by the offset written while it runs: Redis's
/// `TIME` jumps by the step, and a key with a 10 s expiry is gone after a 20 s step.
#[tokio::test]
async fn the_clock_shim_steps_a_running_redis() {
    let redis = match ShimmedRedis::start().await {
        Ok(r) => r,
        Err(e @ ServerError::NotInstalled { .. }) => {
            eprintln!("skipped: {e}");
            return;
        }
        Err(e) => panic!("shimmed redis: {e}"),
    };
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let time = |conn: &mut redis::aio::MultiplexedConnection| {
        let mut conn = conn.clone();
        async move {
            let (s, _us): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
            s
        }
    };
    let before = time(&mut conn).await;
    let _: () = redis::cmd("SET")
        .arg("k")
        .arg("v")
        .arg("PX")
        .arg(10_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        redis.clock().step(Duration::from_secs(20), true).unwrap(),
        20_000
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    let after = time(&mut conn).await;
    assert!((19..=22).contains(&(after - before)), "{before} -> {after}");
    let k: Option<String> = redis::cmd("GET")
        .arg("k")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(k, None, "the key expired by the server's clock");
    assert_eq!(
        redis.clock().step(Duration::from_secs(20), false).unwrap(),
        0
    );
}
