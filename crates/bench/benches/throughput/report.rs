//! The report: the table of figures (medians over rounds), the ratios against their targets,
//! the audit checks, and the JSON document.

use std::path::PathBuf;

use pgfence_bench::median;
use serde_json::{Value as Json, json};

use crate::config::Config;
use crate::measure::Sample;
use crate::sections::{AuditCheck, BATCH_SIZES, Results, batch_tasks};
use crate::servers::{Env, redis_conn};

/// The rows of the table, in order: key and label.
fn rows(cfg: &Config) -> Vec<(String, String)> {
    let mut rows: Vec<(String, String)> = [
        ("write.repo_update", "1a Repository::update (guarded table)"),
        (
            "write.plain_update",
            "1b sqlx plain UPDATE (unguarded table)",
        ),
        ("write.raw_repo_sql", "1c sqlx, the repository's exact SQL"),
        (
            "write.fenced_plain_sql",
            "1d sqlx UPDATE .. AND fence < $3 (hand-written)",
        ),
        (
            "write.repo_update_default_pool",
            "1e 1a with sqlx default PoolOptions",
        ),
        (
            "write.claim_update",
            "1f Repository::claim + update, same lease",
        ),
        (
            "write.plain_update_gated",
            "1g 1b in the write gate's BEGIN .. COMMIT",
        ),
        (
            "pgbench.plain_update",
            "2b pgbench: plain UPDATE (unguarded)",
        ),
        (
            "pgbench.fenced_plain_sql",
            "2d pgbench: UPDATE .. AND fence < tok",
        ),
        ("pgbench.repo_sql", "2c pgbench: the repository's SQL"),
    ]
    .iter()
    .map(|(k, l)| ((*k).to_owned(), (*l).to_owned()))
    .collect();
    for size in BATCH_SIZES {
        let tasks = batch_tasks(cfg.tasks, cfg.rows, size);
        rows.push((
            format!("batch.update_many_{size}"),
            format!("7a update_many, {size}/batch, {tasks} tasks (rows/s)"),
        ));
        rows.push((
            format!("batch.ceiling_{size}"),
            format!("7c pgbench, same batch SQL, {size}/batch (rows/s)"),
        ));
    }
    rows.extend(
        [
            (
                "acquire.issuer_fresh",
                "3a Issuer::acquire (fresh resource)",
            ),
            (
                "acquire.redis_benchmark",
                "3b redis-benchmark EVALSHA acquire.lua",
            ),
            (
                "acquire.redis_benchmark_mt",
                "3b' the same, --threads = workers",
            ),
            ("acquire.issuer_cycle", "3c Issuer acquire+release"),
            (
                "acquire.issuer_cycle_single",
                "3c' 3c, issuer on one multiplexed connection",
            ),
            ("acquire.rslock_cycle", "3d rslock lock+unlock"),
            ("acquire.handrolled_cycle", "3e SET NX PX + Lua compare-DEL"),
            ("job.cycle", "4  acquire -> fenced write -> release"),
            ("storm.rejections", "5a stale writes, rejected + audited"),
            ("storm.all_fresh", "5b fenced writes, all fresh"),
            ("storm.mixed", "5c accepted writes, 10% stale mix"),
        ]
        .iter()
        .map(|(k, l)| ((*k).to_owned(), (*l).to_owned())),
    );
    rows.extend(
        [
            ("etcd.issuer_cycle", "8a EtcdIssuer acquire+release"),
            (
                "etcd.issuer_fresh",
                "8b EtcdIssuer::acquire (fresh resource)",
            ),
            (
                "etcd.raw_cycle",
                "8c raw etcd-client grant+put(lease)+revoke",
            ),
            ("etcd.redis_cycle", "8d Redis Issuer acquire+release (3c)"),
            ("zk.issuer_cycle", "9a ZkIssuer acquire+release"),
            ("zk.issuer_fresh", "9b ZkIssuer::acquire (fresh resource)"),
            (
                "zk.raw_cycle",
                "9c raw zookeeper-client create(eph seq)+delete",
            ),
            ("zk.redis_cycle", "9d Redis Issuer acquire+release (3c)"),
            ("pg.issuer_cycle", "10a PgIssuer acquire+release"),
            ("pg.issuer_fresh", "10b PgIssuer::acquire (fresh resource)"),
            (
                "pg.issuer_fresh_filled",
                "10b' 10b, 10,000 other resources' rows",
            ),
            ("pg.redis_cycle", "10c Redis Issuer acquire+release (3c)"),
            ("pg.advisory_cycle", "10d pg_try_advisory_lock + unlock"),
            (
                "pg.lease_delete_cycle",
                "10e lease table upsert + DELETE (no fence)",
            ),
            (
                "pg.lease_expire_cycle",
                "10e' lease table upsert + expire in place",
            ),
            (
                "pg.functions_prepared",
                "10f issuer functions, prepared statements",
            ),
            (
                "pg.issuer_connect_cycle",
                "10g 10a via PgIssuer::connect (own pool)",
            ),
            ("pg.contended_issuer", "10h contended: PgIssuer (cycles/s)"),
            ("pg.contended_advisory", "10i contended: advisory lock"),
            ("pg.contended_lease", "10j contended: lease table (DELETE)"),
            ("pg.contended_redis", "10k contended: Redis Issuer"),
        ]
        .iter()
        .map(|(k, l)| ((*k).to_owned(), (*l).to_owned())),
    );
    rows.extend(
        [
            ("parts.plain", "11a plain UPDATE (1b, this section)"),
            (
                "parts.unguarded_tl0",
                "11b fenced SQL, no trigger, timeline 0",
            ),
            ("parts.unguarded", "11c fenced SQL, no trigger, timeline"),
            ("parts.guarded_tl0", "11d fenced SQL + trigger, timeline 0"),
            ("parts.guarded", "11e fenced SQL + trigger, timeline (1c)"),
            ("parts.repo", "11f Repository::update, check on (1a)"),
            (
                "parts.repo_tl_off",
                "11g Repository::update, timeline check off",
            ),
            ("scale.write_small", "12a fenced write, 10,000-row table"),
            ("scale.write_big", "12b fenced write, big table (N rows)"),
            ("scale.check_small", "12c pgfence.check, 10,000 marks"),
            ("scale.check_big", "12d pgfence.check, N/10 more marks"),
            ("scale.audit_query", "12e audit --resource --since 1h (ms)"),
            (
                "scale.audit_query_one_conn",
                "12f 12e x20 on one connection (ms)",
            ),
            ("scale.doctor", "12g doctor, no issuer (ms)"),
            ("scale.doctor_redis", "12h doctor, Redis issuer (ms)"),
            ("scale.prune", "12i audit prune, older than 15 days (ms)"),
        ]
        .iter()
        .map(|(k, l)| ((*k).to_owned(), (*l).to_owned())),
    );
    for tasks in crate::sections::COALESCE_TASKS {
        rows.push((
            format!("coalesce.update_c{tasks}"),
            format!("13a Repository::update, {tasks} task(s)"),
        ));
        rows.push((
            format!("coalesce.coalesced_c{tasks}"),
            format!("13b Coalescer::update, {tasks} task(s)"),
        ));
        if tasks > 1 {
            rows.push((
                format!("coalesce.pgbench_c{tasks}"),
                format!("13c pgbench, repository SQL, {tasks} clients"),
            ));
        }
    }
    for c in &cfg.scaling {
        rows.push((
            format!("scaling.c{c}"),
            format!("6  Repository::update, {c} task(s), pool {}", (*c).min(64)),
        ));
    }
    rows
}

/// A ratio between two rows; `target` when the project has one.
struct RatioDef {
    key: &'static str,
    label: &'static str,
    num: &'static str,
    /// The best of these is the denominator.
    den: &'static [&'static str],
    target: Option<f64>,
}

const RATIOS: &[RatioDef] = &[
    RatioDef {
        key: "repo_vs_raw_sql",
        label: "Repository::update / raw sqlx, identical SQL (1a/1c)",
        num: "write.repo_update",
        den: &["write.raw_repo_sql"],
        target: Some(0.95),
    },
    RatioDef {
        key: "guarded_vs_plain",
        label: "fenced+guarded / plain unguarded update (1a/1b)",
        num: "write.repo_update",
        den: &["write.plain_update"],
        target: Some(0.85),
    },
    RatioDef {
        key: "guarded_vs_plain_gated",
        label: "fenced+guarded / plain, both in the write gate (1a/1g)",
        num: "write.repo_update",
        den: &["write.plain_update_gated"],
        target: None,
    },
    RatioDef {
        key: "gate_vs_autocommit",
        label: "the write gate: plain in BEGIN .. COMMIT / plain autocommit (1g/1b)",
        num: "write.plain_update_gated",
        den: &["write.plain_update"],
        target: None,
    },
    RatioDef {
        key: "repo_vs_pgbench",
        label: "Repository::update / pgbench, same SQL (1a/2c)",
        num: "write.repo_update",
        den: &["pgbench.repo_sql"],
        target: Some(0.80),
    },
    RatioDef {
        key: "acquire_vs_redis_benchmark",
        label: "Issuer::acquire / best redis-benchmark EVALSHA (3a/3b)",
        num: "acquire.issuer_fresh",
        den: &["acquire.redis_benchmark", "acquire.redis_benchmark_mt"],
        target: Some(0.80),
    },
    RatioDef {
        key: "cycle_vs_rslock",
        label: "Issuer acquire+release / rslock lock+unlock (3c/3d)",
        num: "acquire.issuer_cycle",
        den: &["acquire.rslock_cycle"],
        target: Some(1.0),
    },
    RatioDef {
        key: "mixed_vs_fresh",
        label: "accepted writes, 10% stale / all fresh (5c/5b)",
        num: "storm.mixed",
        den: &["storm.all_fresh"],
        target: Some(0.90),
    },
    RatioDef {
        key: "batch_10_vs_repo",
        label: "update_many, 10/batch / Repository::update, rows/s (7a/1a)",
        num: "batch.update_many_10",
        den: &["write.repo_update"],
        target: Some(3.0),
    },
    RatioDef {
        key: "batch_1000_vs_repo",
        label: "update_many, 1000/batch / Repository::update (7a/1a)",
        num: "batch.update_many_1000",
        den: &["write.repo_update"],
        target: Some(10.0),
    },
    RatioDef {
        key: "batch_1000_vs_pgbench",
        label: "update_many, 1000/batch / pgbench per-row fenced (7a/2d)",
        num: "batch.update_many_1000",
        den: &["pgbench.fenced_plain_sql"],
        target: Some(5.0),
    },
    RatioDef {
        key: "fence_sql_vs_plain",
        label: "fence + guard, SQL only (1d/1b)",
        num: "write.fenced_plain_sql",
        den: &["write.plain_update"],
        target: None,
    },
    RatioDef {
        key: "classification",
        label: "repository SQL / hand-written fenced UPDATE (1c/1d)",
        num: "write.raw_repo_sql",
        den: &["write.fenced_plain_sql"],
        target: None,
    },
    RatioDef {
        key: "sqlx_vs_pgbench_plain",
        label: "sqlx / pgbench, plain UPDATE (1b/2b)",
        num: "write.plain_update",
        den: &["pgbench.plain_update"],
        target: None,
    },
    RatioDef {
        key: "sqlx_vs_pgbench_fenced",
        label: "sqlx / pgbench, UPDATE .. fence < tok (1d/2d)",
        num: "write.fenced_plain_sql",
        den: &["pgbench.fenced_plain_sql"],
        target: None,
    },
    RatioDef {
        key: "default_pool_vs_tuned",
        label: "sqlx default pool / tuned pool (1e/1a)",
        num: "write.repo_update_default_pool",
        den: &["write.repo_update"],
        target: None,
    },
    RatioDef {
        key: "cycle_single_vs_rslock",
        label: "Issuer acquire+release, one connection / rslock (3c'/3d)",
        num: "acquire.issuer_cycle_single",
        den: &["acquire.rslock_cycle"],
        target: None,
    },
    RatioDef {
        key: "cycle_vs_handrolled",
        label: "Issuer acquire+release / SET NX + compare-DEL (3c/3e)",
        num: "acquire.issuer_cycle",
        den: &["acquire.handrolled_cycle"],
        target: None,
    },
    RatioDef {
        key: "claim_update_vs_update",
        label: "claim + update / Repository::update (1f/1a)",
        num: "write.claim_update",
        den: &["write.repo_update"],
        target: Some(0.6),
    },
    RatioDef {
        key: "batch_100_vs_repo",
        label: "update_many, 100/batch / Repository::update (7a/1a)",
        num: "batch.update_many_100",
        den: &["write.repo_update"],
        target: None,
    },
    RatioDef {
        key: "batch_10_vs_pgbench",
        label: "update_many, 10/batch / pgbench per-row fenced (7a/2d)",
        num: "batch.update_many_10",
        den: &["pgbench.fenced_plain_sql"],
        target: None,
    },
    RatioDef {
        key: "batch_100_vs_pgbench",
        label: "update_many, 100/batch / pgbench per-row fenced (7a/2d)",
        num: "batch.update_many_100",
        den: &["pgbench.fenced_plain_sql"],
        target: None,
    },
    RatioDef {
        key: "batch_10_vs_ceiling",
        label: "update_many, 10/batch / its pgbench ceiling (7a/7c)",
        num: "batch.update_many_10",
        den: &["batch.ceiling_10"],
        target: None,
    },
    RatioDef {
        key: "batch_100_vs_ceiling",
        label: "update_many, 100/batch / its pgbench ceiling (7a/7c)",
        num: "batch.update_many_100",
        den: &["batch.ceiling_100"],
        target: None,
    },
    RatioDef {
        key: "batch_1000_vs_ceiling",
        label: "update_many, 1000/batch / its pgbench ceiling (7a/7c)",
        num: "batch.update_many_1000",
        den: &["batch.ceiling_1000"],
        target: None,
    },
    RatioDef {
        key: "etcd_cycle_vs_raw",
        label: "EtcdIssuer acquire+release / raw etcd-client (8a/8c)",
        num: "etcd.issuer_cycle",
        den: &["etcd.raw_cycle"],
        target: None,
    },
    RatioDef {
        key: "etcd_cycle_vs_redis",
        label: "EtcdIssuer acquire+release / Redis Issuer (8a/8d)",
        num: "etcd.issuer_cycle",
        den: &["etcd.redis_cycle"],
        target: None,
    },
    RatioDef {
        key: "etcd_fresh_vs_raw",
        label: "EtcdIssuer::acquire / raw etcd-client cycle (8b/8c)",
        num: "etcd.issuer_fresh",
        den: &["etcd.raw_cycle"],
        target: None,
    },
    RatioDef {
        key: "zk_cycle_vs_raw",
        label: "ZkIssuer acquire+release / raw zookeeper-client (9a/9c)",
        num: "zk.issuer_cycle",
        den: &["zk.raw_cycle"],
        target: None,
    },
    RatioDef {
        key: "zk_cycle_vs_redis",
        label: "ZkIssuer acquire+release / Redis Issuer (9a/9d)",
        num: "zk.issuer_cycle",
        den: &["zk.redis_cycle"],
        target: None,
    },
    RatioDef {
        key: "zk_fresh_vs_raw",
        label: "ZkIssuer::acquire / raw zookeeper-client cycle (9b/9c)",
        num: "zk.issuer_fresh",
        den: &["zk.raw_cycle"],
        target: None,
    },
    RatioDef {
        key: "pg_cycle_vs_advisory",
        label: "PgIssuer acquire+release / advisory lock+unlock (10a/10d)",
        num: "pg.issuer_cycle",
        den: &["pg.advisory_cycle"],
        target: None,
    },
    RatioDef {
        key: "pg_cycle_vs_lease_delete",
        label: "PgIssuer acquire+release / lease upsert+DELETE (10a/10e)",
        num: "pg.issuer_cycle",
        den: &["pg.lease_delete_cycle"],
        target: None,
    },
    RatioDef {
        key: "pg_cycle_vs_lease_expire",
        label: "PgIssuer acquire+release / lease upsert+expire (10a/10e')",
        num: "pg.issuer_cycle",
        den: &["pg.lease_expire_cycle"],
        target: None,
    },
    RatioDef {
        key: "pg_cycle_vs_redis",
        label: "PgIssuer acquire+release / Redis Issuer (10a/10c)",
        num: "pg.issuer_cycle",
        den: &["pg.redis_cycle"],
        target: None,
    },
    RatioDef {
        key: "pg_fresh_vs_cycle",
        label: "PgIssuer::acquire fresh / PgIssuer cycle (10b/10a)",
        num: "pg.issuer_fresh",
        den: &["pg.issuer_cycle"],
        target: None,
    },
    RatioDef {
        key: "pg_fresh_filled_vs_fresh",
        label: "PgIssuer::acquire fresh, filled / small tables (10b'/10b)",
        num: "pg.issuer_fresh_filled",
        den: &["pg.issuer_fresh"],
        target: None,
    },
    RatioDef {
        key: "pg_cycle_vs_prepared",
        label: "PgIssuer / its functions as prepared statements (10a/10f)",
        num: "pg.issuer_cycle",
        den: &["pg.functions_prepared"],
        target: None,
    },
    RatioDef {
        key: "pg_connect_vs_tuned",
        label: "PgIssuer::connect's pool / the tuned pool (10g/10a)",
        num: "pg.issuer_connect_cycle",
        den: &["pg.issuer_cycle"],
        target: None,
    },
    RatioDef {
        key: "pg_contended_vs_advisory",
        label: "contended: PgIssuer / advisory lock (10h/10i)",
        num: "pg.contended_issuer",
        den: &["pg.contended_advisory"],
        target: None,
    },
    RatioDef {
        key: "pg_contended_vs_lease",
        label: "contended: PgIssuer / lease table (10h/10j)",
        num: "pg.contended_issuer",
        den: &["pg.contended_lease"],
        target: None,
    },
    RatioDef {
        key: "pg_contended_vs_redis",
        label: "contended: PgIssuer / Redis Issuer (10h/10k)",
        num: "pg.contended_issuer",
        den: &["pg.contended_redis"],
        target: None,
    },
    RatioDef {
        key: "parts_total",
        label: "parts: Repository::update / plain UPDATE (11f/11a)",
        num: "parts.repo",
        den: &["parts.plain"],
        target: Some(0.85),
    },
    RatioDef {
        key: "parts_arithmetic",
        label: "parts: fence WHERE/CASE, no trigger, tl 0 / plain (11b/11a)",
        num: "parts.unguarded_tl0",
        den: &["parts.plain"],
        target: None,
    },
    RatioDef {
        key: "parts_trigger",
        label: "parts: + trigger WHEN clause, timeline 0 (11d/11b)",
        num: "parts.guarded_tl0",
        den: &["parts.unguarded_tl0"],
        target: None,
    },
    RatioDef {
        key: "parts_trigger_tl",
        label: "parts: + trigger WHEN clause, timeline bound (11e/11c)",
        num: "parts.guarded",
        den: &["parts.unguarded"],
        target: None,
    },
    RatioDef {
        key: "parts_timeline_unguarded",
        label: "parts: timeline bound / 0, no trigger (11c/11b)",
        num: "parts.unguarded",
        den: &["parts.unguarded_tl0"],
        target: None,
    },
    RatioDef {
        key: "parts_timeline_guarded",
        label: "parts: timeline bound / 0, guarded (11e/11d)",
        num: "parts.guarded",
        den: &["parts.guarded_tl0"],
        target: None,
    },
    RatioDef {
        key: "parts_timeline_repo",
        label: "parts: Repository::update, check on / off (11f/11g)",
        num: "parts.repo",
        den: &["parts.repo_tl_off"],
        target: None,
    },
    RatioDef {
        key: "parts_repository",
        label: "parts: Repository::update / its SQL raw (11f/11e)",
        num: "parts.repo",
        den: &["parts.guarded"],
        target: None,
    },
    RatioDef {
        key: "parts_whole_sql",
        label: "parts: fenced SQL + trigger + timeline / plain (11e/11a)",
        num: "parts.guarded",
        den: &["parts.plain"],
        target: None,
    },
    RatioDef {
        key: "stale_vs_fresh",
        label: "a rejected stale write / a fresh write (5a/5b)",
        num: "storm.rejections",
        den: &["storm.all_fresh"],
        target: None,
    },
    RatioDef {
        key: "scale_write",
        label: "scale: fenced write, N rows / 10,000 rows (12b/12a)",
        num: "scale.write_big",
        den: &["scale.write_small"],
        target: Some(0.90),
    },
    RatioDef {
        key: "scale_check",
        label: "scale: pgfence.check, N/10 marks / 10,000 (12d/12c)",
        num: "scale.check_big",
        den: &["scale.check_small"],
        target: None,
    },
    RatioDef {
        key: "job_vs_write",
        label: "job cycle / Repository::update (4/1a)",
        num: "job.cycle",
        den: &["write.repo_update"],
        target: None,
    },
    RatioDef {
        key: "coalesced_vs_pgbench_16",
        label: "Coalescer::update / pgbench, same single-row SQL, 16 tasks (13b/13c)",
        num: "coalesce.coalesced_c16",
        den: &["coalesce.pgbench_c16"],
        target: Some(1.0),
    },
    RatioDef {
        key: "coalesced_vs_pgbench_64",
        label: "Coalescer::update / pgbench, same single-row SQL, 64 tasks (13b/13c)",
        num: "coalesce.coalesced_c64",
        den: &["coalesce.pgbench_c64"],
        target: Some(1.0),
    },
    RatioDef {
        key: "coalesced_vs_update_16",
        label: "Coalescer::update / Repository::update, 16 tasks (13b/13a)",
        num: "coalesce.coalesced_c16",
        den: &["coalesce.update_c16"],
        target: None,
    },
    RatioDef {
        key: "coalesced_vs_update_64",
        label: "Coalescer::update / Repository::update, 64 tasks (13b/13a)",
        num: "coalesce.coalesced_c64",
        den: &["coalesce.update_c64"],
        target: None,
    },
    RatioDef {
        key: "coalesced_vs_update_1",
        label: "Coalescer::update / Repository::update, 1 task: nothing queued (13b/13a)",
        num: "coalesce.coalesced_c1",
        den: &["coalesce.update_c1"],
        target: Some(0.95),
    },
];

/// `v` with `digits` decimals, or `-`.
fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

/// CPU microseconds: one decimal below 10 (the per-row figures of large batches), else none.
fn fmt_cpu(v: Option<f64>) -> String {
    match v {
        Some(v) if v < 10.0 => format!("{v:.1}"),
        v => fmt_opt(v, 0),
    }
}

/// Prints the tables and builds the JSON document.
pub(crate) fn report(env: &Env, rounds: &[Results], checks: &[AuditCheck], info: &Json) -> Json {
    let cfg = &env.cfg;
    let mut medians = serde_json::Map::new();
    println!();
    println!(
        "pgfence throughput — {} task(s), pool {}, {} rows, {} s measured after {} s warm-up, \
         {} round(s); medians",
        cfg.tasks, cfg.pool, cfg.rows, cfg.secs, cfg.warmup, cfg.rounds
    );
    println!();
    println!(
        "{:<46} {:>9} {:>7} {:>7} {:>6} {:>6} {:>6} {:>6} {:>6} {:>5}  {:<23} notes",
        "measurement",
        "ops/s",
        "p50 ms",
        "p99 ms",
        "cli us",
        "pg us",
        "rds us",
        "oth us",
        "all us",
        "cpus",
        "per round"
    );
    for (key, label) in rows(cfg) {
        let samples: Vec<&Sample> = rounds.iter().filter_map(|r| r.get(&key)).collect();
        if samples.is_empty() {
            continue;
        }
        let med =
            |f: fn(&Sample) -> Option<f64>| median(samples.iter().filter_map(|s| f(s)).collect());
        let ops = med(|s| s.ops_per_sec);
        let p50 = med(|s| s.p50_ms);
        let p99 = med(|s| s.p99_ms);
        let client = med(|s| s.client_cpu_us_per_op);
        let pg = med(|s| s.pg_server_us_per_op);
        let redis = med(|s| s.redis_server_us_per_op);
        let etcd = med(|s| s.etcd_server_us_per_op);
        let zk = med(|s| s.zk_server_us_per_op);
        let wal = med(|s| s.pg_wal_bytes_per_op);
        let seq = med(|s| s.pg_seq_scans_per_op);
        let blocks = med(|s| s.pg_blocks_per_op);
        let machine = med(|s| s.machine_cpu_us_per_op);
        let other = med(Sample::other_cpu_us_per_op);
        let busy = med(|s| s.busy_cpus);
        let per_round: Vec<String> = samples.iter().map(|s| fmt_opt(s.ops_per_sec, 0)).collect();
        let bad: u64 = samples.iter().map(|s| s.failed).sum();
        let mut notes = Vec::new();
        if bad > 0 {
            notes.push(format!("{bad} failed"));
        }
        if let Some(etcd) = etcd {
            notes.push(format!("etcd server {} us/op", fmt_cpu(Some(etcd))));
        }
        if let Some(zk) = zk {
            notes.push(format!("zk server {} us/op", fmt_cpu(Some(zk))));
        }
        if let Some(wal) = wal {
            notes.push(format!("WAL {wal:.0} B/op"));
        }
        if let Some(seq) = seq {
            notes.push(format!("{seq:.2} seq scans/op"));
        }
        if let Some(blocks) = blocks {
            notes.push(format!("{blocks:.0} blocks/op"));
        }
        if let Some(n) = samples.last().and_then(|s| s.note.clone()) {
            notes.push(n);
        }
        println!(
            "{label:<46} {:>9} {:>7} {:>7} {:>6} {:>6} {:>6} {:>6} {:>6} {:>5}  {:<23} {}",
            fmt_opt(ops, 0),
            fmt_opt(p50, 2),
            fmt_opt(p99, 2),
            fmt_cpu(client),
            fmt_cpu(pg),
            fmt_cpu(redis),
            fmt_cpu(other),
            fmt_cpu(machine),
            fmt_opt(busy, 2),
            per_round.join(" / "),
            notes.join("; ")
        );
        medians.insert(
            key,
            json!({
                "ops_per_sec": ops, "p50_ms": p50, "p99_ms": p99,
                "client_cpu_us_per_op": client, "machine_cpu_us_per_op": machine,
                "pg_server_cpu_us_per_op": pg, "other_cpu_us_per_op": other,
                "redis_server_us_per_op": redis, "etcd_server_us_per_op": etcd,
                "zk_server_us_per_op": zk, "pg_wal_bytes_per_op": wal,
                "pg_seq_scans_per_op": seq, "pg_blocks_per_op": blocks,
                "busy_cpus": busy,
            }),
        );
    }

    println!(
        "CPU microseconds per operation — cli: the client (this process or the tool); pg: the \
         PostgreSQL server; rds: the Redis server (warm-up included); etcd / zk server (notes): its process, \
         warm-up included; WAL, seq scans, blocks (notes, section pg): PostgreSQL WAL bytes, \
         sequential scans and buffer accesses of the section's tables per operation, warm-up \
         included; oth: everything else on the \
         machine (other work skews a row: check it); all: the whole machine; \
         cpus: busy CPUs in the window (of {}). Batch rows (7a, 7c): ops/s and CPU are per \
         row, p50/p99 per batch",
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    println!();
    println!(
        "{:<58} {:>7} {:>7}  {:<8} per round",
        "ratio (median of per-round ratios)", "value", "target", "result"
    );
    let mut ratios = serde_json::Map::new();
    for def in RATIOS {
        let per_round: Vec<f64> = rounds
            .iter()
            .filter_map(|r| {
                let n = r.get(def.num)?.ops_per_sec?;
                let d = def
                    .den
                    .iter()
                    .filter_map(|k| r.get(*k)?.ops_per_sec)
                    .reduce(f64::max)?;
                (d > 0.0).then_some(n / d)
            })
            .collect();
        let value = median(per_round.clone());
        let result = match (value, def.target) {
            (None, _) => "n/a",
            (Some(_), None) => "info",
            (Some(v), Some(t)) if v >= t => "MET",
            (Some(_), Some(_)) => "MISSED",
        };
        println!(
            "{:<58} {:>7} {:>7}  {result:<8} {}",
            def.label,
            fmt_opt(value, 3),
            fmt_opt(def.target, 2),
            per_round
                .iter()
                .map(|v| format!("{v:.3}"))
                .collect::<Vec<_>>()
                .join(" / ")
        );
        ratios.insert(
            def.key.to_owned(),
            json!({
                "label": def.label, "numerator": def.num, "denominator": def.den,
                "value": value, "per_round": per_round, "target": def.target, "result": result,
            }),
        );
    }

    if !checks.is_empty() {
        println!();
        for c in checks {
            println!(
                "audit check {:<32} {} rejections, {} audit rows: {}",
                c.what,
                c.rejections,
                c.audit_rows,
                if c.pass { "PASS" } else { "FAIL" }
            );
        }
    }
    let matches = env.repo_sql_matches();
    println!();
    println!(
        "repository SQL (Repository::update_sql; {} by the server for one Repository::update, \
         per pg_prepared_statements):\n  {}",
        if matches {
            "the statement prepared"
        } else {
            "NOT the statement prepared"
        },
        env.repo_sql
    );
    if !matches {
        for sql in &env.repo_sql_prepared {
            println!("  prepared: {sql}");
        }
    }

    match &env.batch_sql {
        Ok(sql) => println!(
            "\nbatch statement (Repository::update_many, as prepared by the server for one real \
             batch; 7c binds the same four parameters: int4[] keys drawn by a SELECT .. \\gset, \
             text[] payloads, int8 :tok, the timeline :timeline):\n  {sql}"
        ),
        Err(why) => println!("\nbatch statement not captured: {why}"),
    }

    json!({
        "batch_sql": env.batch_sql.as_ref().ok(),
        "config": cfg,
        "environment": info,
        "repository_sql": env.repo_sql,
        "repository_sql_prepared_by_server": matches,
        "prepared_statements_on_table": env.repo_sql_prepared,
        "medians": medians,
        "ratios": ratios,
        "audit_checks": checks,
        "rounds": rounds,
    })
}

/// Whether the figure `key` rejects operations by design: stale writes (`storm`) and locks
/// every task contends for.
fn rejects_by_design(key: &str) -> bool {
    matches!(key, "storm.rejections" | "storm.mixed") || key.starts_with("pg.contended_")
}

/// What went wrong in the run, whatever its figures: failed operations, unexpected
/// rejections (a write that should apply, a lock that should be free), figures that measured
/// nothing, an external tool's failures ([`Sample::problem`]), and the repository's
/// statements not being what the server ran. Rows skipped because an optional tool
/// (`pgbench`, `redis-benchmark`) is missing are not problems. Empty: the run is sound.
pub(crate) fn problems(env: &Env, rounds: &[Results]) -> Vec<String> {
    let mut found = Vec::new();
    for (i, round) in rounds.iter().enumerate() {
        for (key, s) in round {
            let at = format!("round {} {key}", i + 1);
            let note = s.note.as_deref().unwrap_or("");
            if s.failed > 0 {
                found.push(format!("{at}: {} failed operations ({note})", s.failed));
            }
            if s.rejected > 0 && !rejects_by_design(key) {
                found.push(format!("{at}: {} unexpected rejections", s.rejected));
            }
            if s.ops_per_sec.is_some_and(|r| r <= 0.0) {
                found.push(format!("{at}: no operation completed ({note})"));
            }
            if let Some(p) = &s.problem {
                found.push(format!("{at}: {p}"));
            }
        }
    }
    if !env.repo_sql_matches() {
        found.push(
            "the repository's update SQL (Repository::update_sql) is not what the server \
             prepared for Repository::update"
                .to_owned(),
        );
    }
    if env.cfg.runs("batch")
        && let Err(why) = &env.batch_sql
    {
        found.push(format!("the batch statement could not be captured: {why}"));
    }
    found
}

/// Facts about the machine and the servers, for the report.
pub(crate) async fn environment(env: &Env, pg_source: &str, redis_source: &str) -> Json {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:").map(|m| m.trim().to_owned()));
    let pg_version: Option<String> = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&env.admin)
        .await
        .ok();
    let redis_version = match redis_conn(&env.redis_url).await {
        Ok(mut c) => redis::cmd("INFO")
            .arg("server")
            .query_async::<String>(&mut c)
            .await
            .ok()
            .and_then(|i| {
                i.lines()
                    .find_map(|l| l.strip_prefix("redis_version:").map(str::to_owned))
            }),
        Err(_) => None,
    };
    let version = |bin: &Option<PathBuf>| {
        bin.as_ref().and_then(|b| {
            let out = std::process::Command::new(b)
                .arg("--version")
                .output()
                .ok()?;
            Some(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        })
    };
    json!({
        "cpus": std::thread::available_parallelism().map_or(0, usize::from),
        "cpu_model": cpu,
        "memory": mem,
        "postgres": pg_version,
        "postgres_server": pg_source,
        "redis": redis_version,
        "redis_server": redis_source,
        "pgbench": version(&env.pgbench),
        "redis_benchmark": version(&env.redis_benchmark),
    })
}
