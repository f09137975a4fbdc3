//! `cargo bench --bench throughput`: pgfence's write and lock throughput next to the baselines
//! that bound it, measured in one run on the same servers.
//!
//! Sections (run all, or name some: `cargo bench --bench throughput -- write acquire`):
//!
//! - `write`: (1a) [`Repository::update`] on a guarded table; (1b) raw sqlx
//!   `UPDATE .. SET payload = $1 WHERE id = $2` on an identical unguarded table (no `fence`
//!   column, no trigger); (1c) raw sqlx running the exact SQL text the repository sends
//!   ([`Repository::update_sql`], checked against `pg_prepared_statements` after one real
//!   `Repository::update`); (1d) raw sqlx `UPDATE .. WHERE id = $1 AND fence < $3` on the
//!   guarded table, the same statement as a person would write it; (1e) 1a through a pool with
//!   sqlx's default options; (1f) [`Repository::claim`] then [`Repository::update`] of the
//!   row with the same lease (a read-modify-write, two statements).
//! - `pgbench`: 1b, 1d and 1c through `pgbench -M prepared`, the C client as a ceiling.
//! - `batch`: [`Repository::update_many`] of 10, 100 and 1,000 rows per batch (a fresh token
//!   per batch), in rows/s, against the same round's 1a and 2d; and the same batch statement
//!   (captured from `pg_prepared_statements`) through pgbench, the Postgres-side ceiling.
//! - `acquire`: [`RedisIssuer::acquire`] on a fresh resource each time vs `redis-benchmark` sending
//!   the same Lua script by `EVALSHA` on fresh random keys; acquire+release cycles (also with
//!   the issuer on one multiplexed connection) vs the `rslock` crate's lock+unlock and a
//!   hand-rolled `SET NX PX` + Lua compare-and-delete.
//! - `job`: acquire → fenced write → release.
//! - `storm`: stale writes (every one rejected and audited; the audit row count is checked),
//!   then all-fresh writes and a 10 % stale mix.
//! - `scaling`: 1a at several concurrencies, pool size = concurrency (at most 64).
//! - `etcd` (feature `etcd`): pgfence's `EtcdIssuer` acquire+release and acquire-only, a raw
//!   etcd-client grant + put-with-lease + revoke loop through the same client (the ceiling),
//!   and the Redis issuer's acquire+release in the same round, on a throwaway single-node etcd
//!   (or `PGFENCE_ETCD_URL`). Without the feature it prints how to enable it.
//! - `zk` (feature `zk`): pgfence's `ZkIssuer` acquire+release and acquire-only, a raw
//!   zookeeper-client create (ephemeral sequential) + delete loop through a session of its own
//!   (the ceiling), and the Redis issuer's acquire+release in the same round, on a throwaway
//!   standalone ZooKeeper (or `PGFENCE_ZK_URL`). Without the feature it prints how to enable
//!   it.
//! - `pg`: pgfence's `PgIssuer` (leases and tokens in PostgreSQL) acquire+release and
//!   acquire-only, next to `pg_try_advisory_lock` + `pg_advisory_unlock`, a hand-written
//!   lease-table upsert (released by `DELETE`, or by expiring the row in place), the issuer's
//!   functions through prepared statements, `PgIssuer::connect`'s own pool, and the Redis
//!   issuer's acquire+release in the same round; then the same locks contended (every task
//!   on one resource). PostgreSQL CPU and WAL per operation (see `pg`).
//! - `parts`: the fenced + guarded write taken apart against the same plain `UPDATE`, in one
//!   round: the repository's SQL on a copy of the table without the trigger and on the
//!   guarded table, each with the timeline bound and with timeline 0, and
//!   [`Repository::update`] with the database's timeline check on and off (see `parts`).
//! - `scale` (opt-in: run only when named, or when `PGFENCE_BENCH_SCALE_ROWS` is set): fenced
//!   writes on a table of N rows against 10,000, `pgfence.check` with N/10 resource marks,
//!   the audit query on N audit rows, doctor on N/10,000 guarded tables, audit prune (see
//!   `scale`).
//! - `idle` (opt-in: run only when named): the issuer state 100,000 idle resources leave
//!   (Redis keys and bytes, PostgreSQL issuer rows), kept and with idle expiry (see `idle`).
//!
//! Every figure waits for an idle machine first, and records CPU time per operation of the
//! client, the PostgreSQL server, the Redis server and everything else (see BENCHMARKS.md).
//! The tables are written once, unmeasured, before round 1, and vacuumed before every figure.
//!
//! Fairness rules: every client gets the same pool size / connection count and concurrency;
//! Postgres pools are opened with `min_connections = max_connections` and
//! `test_before_acquire(false)` (1e shows what sqlx's default costs); keys are uniform random,
//! partitioned so that task `i` (pgbench client `i`) only touches ids `≡ i (mod tasks)`, which
//! keeps every write's token newer than its row's fence (tokens come from one global
//! `AtomicI64`; pgbench counts per client from a start above every fence).
//!
//! Servers: `DATABASE_URL` / `REDIS_URL` when set, else throwaway servers
//! ([`pgfence_testkit::Server`]). A fresh database is created (and dropped at the end) and
//! migrated with [`pgfence::admin::migrate`].
//!
//! Settings (environment): `PGFENCE_BENCH_SECS` (3), `PGFENCE_BENCH_WARMUP` (1),
//! `PGFENCE_BENCH_TASKS` (16), `PGFENCE_BENCH_POOL` (= tasks), `PGFENCE_BENCH_ROWS` (10000),
//! `PGFENCE_BENCH_ROUNDS` (3; figures are medians over rounds), `PGFENCE_BENCH_SCALING`
//! (`1,4,16,64`), `PGFENCE_BENCH_WORKERS` (tokio worker threads, default: CPUs),
//! `PGFENCE_BENCH_QUIET_WAIT` (30: at most this many seconds each figure waits for an idle
//! machine; 0: none), `PGFENCE_BENCH_SCALE_ROWS` (section `scale`'s N, 10,000,000; setting
//! it runs the section), `PGFENCE_BENCH_JSON` (default `bench-throughput.json` in the build's
//! target directory: `$CARGO_TARGET_DIR`, else the workspace's `target/`).
//!
//! Run without `--bench` (as `cargo test --all-targets` does), it only prints how to run it.
//!
//! Modules: [`config`] (settings), `coord` (what sections `etcd`, `zk` and `pg` share), `pg`
//! (section `pg`), [`servers`] (servers, database, tables), [`measure`] (the
//! measuring loop), [`cpu`] (CPU accounting per process), [`workloads`] (pgfence and sqlx
//! loads), [`baselines`] (pgbench, redis-benchmark, rslock, a hand-rolled lock),
//! [`sections`] (what each section measures), [`parts`] and [`scale`] (sections `parts` and
//! `scale`), [`report`] (tables and JSON).
//!
//! [`Repository::update`]: pgfence::Repository::update
//! [`Repository::update_sql`]: pgfence::Repository::update_sql
//! [`Repository::claim`]: pgfence::Repository::claim
//! [`Repository::update_many`]: pgfence::Repository::update_many
//! [`RedisIssuer::acquire`]: pgfence::RedisIssuer::acquire

// A benchmark's report is its standard output.
#![allow(clippy::print_stdout)]

mod baselines;
mod config;
mod coord;
mod cpu;
#[cfg(feature = "etcd")]
mod etcd;
mod idle;
mod measure;
mod parts;
mod pg;
mod report;
mod scale;
mod sections;
mod servers;
mod workloads;
#[cfg(feature = "zk")]
mod zk;

use std::time::Duration;

use anyhow::{Result, bail};
use serde_json::json;

use crate::config::Config;
use crate::sections::Results;
use crate::servers::{Env, Servers};

/// Every row's payload (and every write's): 32 bytes, as in the initial data.
const PAYLOAD: &str = "0123456789abcdef0123456789abcdef";

/// Lease TTL for every lock taken here.
const LEASE_TTL: Duration = Duration::from_secs(30);

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") {
        println!(
            "throughput: benchmark, not run under `cargo test`; use `cargo bench --bench throughput`"
        );
        return Ok(());
    }
    let cfg = Config::from_env(&args)?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.workers)
        .enable_all()
        .build()?
        .block_on(run(cfg))
}

/// Starts (or connects to) the servers, runs the benchmark in a fresh database, and cleans up
/// whatever happened.
async fn run(cfg: Config) -> Result<()> {
    let servers = Servers::start().await?;
    let run_id = format!("pgfbench-{:08x}", rand::random::<u32>());
    let db_name = format!(
        "pgfence_bench_{}_{}",
        std::process::id(),
        rand::random::<u32>()
    );
    servers.create_database(&db_name).await?;
    let scratch = std::env::temp_dir().join(&run_id);
    std::fs::create_dir_all(&scratch)?;

    let result = match Env::open(cfg, &servers, &db_name, run_id.clone(), scratch.clone()).await {
        Ok(env) => bench(&env, &servers).await,
        Err(e) => Err(e),
    };

    // The database, the scripts, and this run's keys in a Redis we did not start.
    let _ = std::fs::remove_dir_all(&scratch);
    servers.cleanup(&db_name, &run_id).await;
    drop(servers);
    result
}

/// Conditions the tables, runs the selected sections for every round, and reports.
async fn bench(env: &Env, servers: &Servers) -> Result<()> {
    let info = report::environment(env, servers.pg_source, servers.redis_source).await;
    eprintln!("{info}");

    let mut rounds = Vec::new();
    let mut checks = Vec::new();
    if [
        "write", "pgbench", "batch", "job", "storm", "scaling", "parts", "coalesce",
    ]
    .iter()
    .any(|s| env.cfg.runs(s))
    {
        sections::condition(env).await?;
    }
    #[cfg(feature = "etcd")]
    let etcd_server = if env.cfg.runs("etcd") {
        let server = etcd::EtcdServer::start().await?;
        eprintln!("etcd: {}", server.describe());
        Some(server)
    } else {
        None
    };
    #[cfg(not(feature = "etcd"))]
    if env.cfg.runs("etcd") {
        eprintln!(
            "section etcd skipped: built without feature `etcd` (run `cargo bench -p pgfence-bench \
             --features etcd --bench throughput -- etcd`)"
        );
    }
    #[cfg(feature = "zk")]
    let zk_server = if env.cfg.runs("zk") {
        let server = zk::ZkServer::start().await?;
        eprintln!("zk: {}", server.describe());
        Some(server)
    } else {
        None
    };
    #[cfg(not(feature = "zk"))]
    if env.cfg.runs("zk") {
        eprintln!(
            "section zk skipped: built without feature `zk` (run `cargo bench -p pgfence-bench \
             --features zk --bench throughput -- zk`)"
        );
    }
    let mut scale_setup = if env.cfg.runs("scale") {
        Some(scale::prepare(env).await?)
    } else {
        None
    };
    let idle_state = if env.cfg.runs("idle") {
        Some(idle::idle(env).await?)
    } else {
        None
    };
    let mut loads = Vec::new();
    for round in 1..=env.cfg.rounds {
        let mut out = Results::new();
        if let Some(setup) = &mut scale_setup {
            out.extend(setup.pre.drain(..));
        }
        // Other work on the machine skews everything: record the load each round starts with.
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        eprintln!("round {round}: load average {}", load.trim());
        loads.push(load.trim().to_owned());
        if env.cfg.runs("write") {
            sections::write(env, round, &mut out).await?;
        }
        if env.cfg.runs("pgbench") {
            sections::pgbench(env, round, &mut out).await?;
        }
        if env.cfg.runs("batch") {
            sections::batch(env, round, &mut out).await?;
        }
        if env.cfg.runs("acquire") {
            sections::acquire(env, round, &mut out).await?;
        }
        if env.cfg.runs("job") {
            sections::job(env, round, &mut out).await?;
        }
        if env.cfg.runs("storm") {
            sections::storm(env, round, &mut out, &mut checks).await?;
        }
        if env.cfg.runs("scaling") {
            sections::scaling(env, round, &mut out).await?;
        }
        #[cfg(feature = "etcd")]
        if let Some(server) = &etcd_server {
            etcd::etcd(env, server, round, &mut out).await?;
        }
        #[cfg(feature = "zk")]
        if let Some(server) = &zk_server {
            zk::zk(env, server, round, &mut out).await?;
        }
        if env.cfg.runs("pg") {
            pg::pg(env, round, &mut out).await?;
        }
        if env.cfg.runs("parts") {
            parts::parts(env, round, &mut out).await?;
        }
        if env.cfg.runs("coalesce") {
            sections::coalesce(env, round, &mut out).await?;
        }
        if let Some(setup) = &scale_setup {
            let last = round == env.cfg.rounds;
            scale::scale(env, setup, round, last, &mut out).await?;
        }
        rounds.push(out);
    }

    let mut doc = report::report(env, &rounds, &checks, &info);
    println!(
        "load average at the start of each round: {}",
        loads.join(" | ")
    );
    doc["load_average_at_round_start"] = json!(loads);
    if let Some(state) = idle_state {
        doc["idle_state"] = state;
    }
    let problems = report::problems(env, &rounds);
    doc["problems"] = json!(problems);
    if let Some(dir) = env.cfg.json.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&env.cfg.json, serde_json::to_string_pretty(&doc)?)?;
    println!();
    println!("figures written to {}", env.cfg.json.display());
    env.admin.close().await;
    if !problems.is_empty() {
        println!();
        for p in &problems {
            println!("PROBLEM: {p}");
        }
    }
    if checks.iter().any(|c| !c.pass) {
        bail!("an audit check failed");
    }
    if !problems.is_empty() {
        bail!(
            "{} problem(s) in the run (listed above): a figure that did not measure what it \
             says",
            problems.len()
        );
    }
    Ok(())
}
