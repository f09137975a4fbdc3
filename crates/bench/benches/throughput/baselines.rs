//! The external baselines: PostgreSQL's C client (`pgbench`), Redis's (`redis-benchmark`), the
//! `rslock` crate, and a hand-rolled lock without a token.

use std::path::Path;
use std::sync::LazyLock;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use pgfence_bench::number_after;
use redis::aio::ConnectionManager;

use crate::cpu::{cpu_snap, quiet_gate, redis_usec};
use crate::measure::{Outcome, Sample, TOKENS, Workload, lease_fence};
use crate::servers::{Env, prefix, prep, redis_conn, resync_tokens};
use crate::{LEASE_TTL, PAYLOAD};

/// The acquire script, byte for byte what [`pgfence::RedisIssuer::acquire`] sends (the library's
/// own file).
const ACQUIRE_LUA: &str = include_str!("../../../../src/issuer/redis/lua/acquire.lua");

/// The hand-rolled baseline's release: delete the key only if it still holds our value.
const COMPARE_DEL_LUA: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

// ---------------------------------------------------------------------------------------------
// pgbench

/// `n_tup_upd` of `table`, after giving exited backends a moment to flush their statistics.
async fn updates_counted(env: &Env, table: &str) -> Result<i64> {
    tokio::time::sleep(Duration::from_millis(700)).await;
    Ok(sqlx::query_scalar(
        "SELECT coalesce(n_tup_upd, 0) FROM pg_stat_user_tables WHERE relname = $1",
    )
    .bind(table)
    .fetch_one(&env.admin)
    .await?)
}

/// One pgbench run with `clients` clients and extra `-D` variables; returns its stdout.
async fn run_pgbench(
    env: &Env,
    bin: &Path,
    script: &Path,
    secs: u64,
    clients: usize,
    defines: &[(String, String)],
) -> Result<String> {
    let threads = env.cfg.workers.clamp(1, clients);
    resync_tokens(env).await?;
    // Every client counts from here: the lease fence of the next token.
    let start = lease_fence(TOKENS.load(Ordering::SeqCst) + 1);
    let out = tokio::process::Command::new(bin)
        .args(["-n", "-M", "prepared"])
        .args(["-c", &clients.to_string(), "-j", &threads.to_string()])
        .args(["-T", &secs.to_string()])
        .args(["-D", &format!("tok={start}")])
        .args(["-D", &format!("payload={PAYLOAD}")])
        // The lease's timeline, for the repository's statements (see `Env::timeline`).
        .args(["-D", &format!("timeline={}", env.timeline)])
        .args(
            defines
                .iter()
                .flat_map(|(k, v)| ["-D".to_owned(), format!("{k}={v}")]),
        )
        .arg("-f")
        .arg(script)
        .arg(&env.db_url)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "pgbench failed ({}): {}{}",
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    resync_tokens(env).await?;
    Ok(stdout)
}

/// The row `name`: `body` (one statement with pgbench variables `:id`, `:payload`, `:tok`,
/// `:timeline`) through `pgbench -M prepared`, rows counted on `table`. Each transaction of a client
/// takes the next id of that client's rows and the next token: `:tok` is its lease fence, as
/// the repository would bind it (it starts above every fence and steps by the difference
/// between the lease fences of successive tokens).
pub(crate) async fn pgbench_row(env: &Env, name: &str, table: &str, body: &str) -> Result<Sample> {
    pgbench_row_with(env, name, table, body, env.cfg.tasks).await
}

/// [`pgbench_row`] with `clients` clients.
pub(crate) async fn pgbench_row_with(
    env: &Env,
    name: &str,
    table: &str,
    body: &str,
    clients: usize,
) -> Result<Sample> {
    let cfg = &env.cfg;
    let slots = cfg.rows / i32::try_from(clients)?;
    let text = format!(
        "\\set id 1 + :client_id + {tasks} * random(0, {last})\n\\set tok :tok + {step}\n{body};\n",
        tasks = clients,
        last = slots - 1,
        step = lease_fence(2) - lease_fence(1),
    );
    pgbench_script(env, name, table, &text, clients, 1, &[]).await
}

/// 7c: the Postgres-side ceiling of a batch of `size` rows: `batch_sql` — the statement
/// [`pgfence::Repository::update_many`] sends, captured from the server — through `pgbench -M
/// prepared` with `clients` clients, its four parameters bound as the library binds them (an
/// `int4[]` of keys, a `text[]` of payloads, the `int8` lease fence, and the lease's timeline,
/// which the statement casts to `int8` itself: `Env::timeline`), so that the server plans and
/// runs the same prepared statement. pgbench cannot build an array, so each transaction
/// first draws its keys with one small `SELECT .. \gset` (client `c`'s ids `1 + c + clients *
/// slot` for the batch's slots, from a random start spread by [`pgfence_bench::spread_step`]:
/// the ids the Rust batch rows write, see `BatchKeys`); the payloads are one constant array
/// (`-D payloads=..`); `:tok` is a fresh lease fence per transaction, as in [`pgbench_row`].
/// Rate and CPU are per row; the key `SELECT` is included (one extra statement per batch).
pub(crate) async fn pgbench_batch_row(
    env: &Env,
    name: &str,
    batch_sql: &str,
    size: usize,
    clients: usize,
) -> Result<Sample> {
    let slots = u64::try_from(env.cfg.rows)? / u64::try_from(clients)?;
    let step = pgfence_bench::spread_step(slots);
    let body = pgfence_bench::pgbench_params(
        batch_sql,
        &[
            ":keys::int4[]",
            ":payloads::text[]",
            ":tok::int8",
            ":timeline",
        ],
    )
    .map_err(anyhow::Error::msg)?;
    let text = format!(
        "\\set start random(0, {last_slot})\n\\set tok :tok + {fstep}\n\
         SELECT pg_catalog.array_agg((1 + :client_id::int8 + {clients} * \
         ((:start::int8 + j * {step}) % {slots}))::int4)::text AS keys \
         FROM pg_catalog.generate_series(0::int8, {last}) j \\gset\n{body};\n",
        last_slot = slots - 1,
        last = size - 1,
        fstep = lease_fence(2) - lease_fence(1),
    );
    let payloads = format!("{{{}}}", vec![PAYLOAD; size].join(","));
    let defines = [("payloads".to_owned(), payloads)];
    let rows = u64::try_from(size)?;
    let mut sample =
        pgbench_script(env, name, "bench_guarded", &text, clients, rows, &defines).await?;
    sample.per_row(rows);
    Ok(sample)
}

/// Runs the pgbench script `text` with `clients` clients (unmeasured for the warm-up, then
/// measured), checking with `pg_stat_user_tables` that each transaction updated `rows_per_tx`
/// rows of `table`; `defines` are extra `-D` variables. The figure is per transaction.
async fn pgbench_script(
    env: &Env,
    name: &str,
    table: &str,
    text: &str,
    clients: usize,
    rows_per_tx: u64,
    defines: &[(String, String)],
) -> Result<Sample> {
    let Some(bin) = &env.pgbench else {
        return Ok(Sample::skipped(
            "pgbench not found (PATH, /usr/lib/postgresql/*/bin)",
        ));
    };
    let cfg = &env.cfg;
    let script = env.scratch.join(format!("{name}.sql"));
    std::fs::write(&script, text)?;
    prep(env).await?;
    run_pgbench(env, bin, &script, cfg.warmup, clients, defines).await?;
    let before = updates_counted(env, table).await?;
    let quiet_wait_s = quiet_gate(env.cfg.quiet_wait).await;
    let (started, cpu_before) = (Instant::now(), cpu_snap());
    let stdout = run_pgbench(env, bin, &script, cfg.secs, clients, defines).await?;
    let (seconds, cpu_after) = (started.elapsed().as_secs_f64(), cpu_snap());
    let after = updates_counted(env, table).await?;
    let tps = number_after(&stdout, "tps =").context("no `tps =` line in pgbench's output")?;
    let processed =
        number_after(&stdout, "number of transactions actually processed:").unwrap_or(0.0);
    let failed = number_after(&stdout, "number of failed transactions:").unwrap_or(0.0);
    let applied_share = if processed > 0.0 {
        (after - before) as f64 / processed / rows_per_tx as f64
    } else {
        0.0
    };
    let note = format!(
        "{processed:.0} transactions, {failed:.0} failed; rows updated per transaction \
         (pg_stat n_tup_upd) / {rows_per_tx} = {applied_share:.3}"
    );
    // Every transaction updates its rows (the scripts present fresh tokens on the client's
    // own rows): a statement that updates nothing runs fast and means nothing.
    let wrong = failed > 0.0 || processed < 1.0 || (applied_share - 1.0).abs() > 0.01;
    let mut sample = Sample {
        ops_per_sec: Some(tps),
        seconds,
        avg_ms: number_after(&stdout, "latency average ="),
        quiet_wait_s,
        problem: wrong.then(|| note.clone()),
        note: Some(note),
        ..Sample::default()
    };
    // The window includes pgbench's start-up and connections: a slight overestimate per op.
    let ops = format!("{processed:.0}").parse().unwrap_or(0);
    sample.cpu(cpu_before, cpu_after, ops, true);
    Ok(sample)
}

// ---------------------------------------------------------------------------------------------
// redis-benchmark

/// `total_error_replies` from `INFO stats` (Redis 6.2+), if present.
async fn redis_error_replies(conn: &mut redis::aio::MultiplexedConnection) -> Option<u64> {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(conn)
        .await
        .ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("total_error_replies:"))
        .and_then(|v| v.trim().parse().ok())
}

/// One redis-benchmark run of `EVALSHA acquire.lua` on fresh random keys with `threads`
/// client threads; returns the CSV fields of its result line.
async fn run_redis_benchmark(
    env: &Env,
    bin: &Path,
    sha: &str,
    n: u64,
    threads: usize,
) -> Result<Vec<String>> {
    let tag = prefix(env, "rb");
    let mut cmd = tokio::process::Command::new(bin);
    if threads > 1 {
        cmd.args(["--threads", &threads.to_string()]);
    }
    let out = cmd
        .args(["-u", &env.redis_url, "-c", &env.cfg.tasks.to_string()])
        .args(["-n", &n.to_string(), "-r", "1000000000", "--csv"])
        // What `acquire` sends: the lock and counter keys; owner, TTL, token limit and the
        // call's id (no attempt key: `acquire`'s owner id is the call's own; `acquire_as`
        // adds the attempt key and the script one more SET).
        .args(["EVALSHA", sha, "2"])
        .arg(format!("pgfence:{{{tag}:__rand_int__}}:lock"))
        .arg(format!("pgfence:{{{tag}:__rand_int__}}:fence"))
        .arg("0123456789abcdef0123456789abcdef")
        .arg(LEASE_TTL.as_millis().to_string())
        .arg(pgfence::token::MAX_TOKEN.to_string())
        .arg("0000000000000001")
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!("redis-benchmark failed ({}): {stdout}", out.status);
    }
    let line = stdout
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("\"evalsha"))
        .with_context(|| format!("no result line in redis-benchmark's output: {stdout}"))?;
    // The command (first field) has no commas; the rest are numbers.
    Ok(line
        .split(',')
        .map(|f| f.trim_matches('"').to_owned())
        .collect())
}

/// 3b: `redis-benchmark` sending the issuer's acquire script by `EVALSHA` on fresh random
/// keys, with `threads` client threads.
pub(crate) async fn redis_benchmark_row(env: &Env, threads: usize) -> Result<Sample> {
    let Some(bin) = &env.redis_benchmark else {
        return Ok(Sample::skipped(
            "redis-benchmark not found (PATH, /usr/bin)",
        ));
    };
    let mut conn = redis_conn(&env.redis_url).await?;
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(ACQUIRE_LUA)
        .query_async(&mut conn)
        .await?;
    let errors_before = redis_error_replies(&mut conn).await;
    // Warm-up, which also sizes the measured run to about `secs` seconds.
    let warm = run_redis_benchmark(env, bin, &sha, 20_000, threads).await?;
    let rate: u64 = warm
        .get(1)
        .and_then(|r| r.split('.').next())
        .and_then(|r| r.parse().ok())
        .context("redis-benchmark rps")?;
    let n = (rate * env.cfg.secs).max(20_000);
    let quiet_wait_s = quiet_gate(env.cfg.quiet_wait).await;
    let (cpu_before, usec_before) = (cpu_snap(), redis_usec(&mut conn).await);
    let fields = run_redis_benchmark(env, bin, &sha, n, threads).await?;
    let (cpu_after, usec_after) = (cpu_snap(), redis_usec(&mut conn).await);
    let num = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
    let error_replies = match (errors_before, redis_error_replies(&mut conn).await) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    let errors = error_replies.map_or_else(
        || "error replies unknown".to_owned(),
        |n| format!("{n} error replies"),
    );
    let rps = num(1).context("redis-benchmark rps")?;
    let mut sample = Sample {
        ops_per_sec: Some(rps),
        seconds: n as f64 / rps,
        avg_ms: num(2),
        p50_ms: num(4),
        p99_ms: num(6),
        total_ops: n,
        quiet_wait_s,
        problem: error_replies
            .filter(|&e| e > 0)
            .map(|e| format!("{e} error replies from Redis to the acquire script")),
        note: Some(format!(
            "{n} requests, {threads} client thread(s), {errors}"
        )),
        ..Sample::default()
    };
    sample.cpu(cpu_before, cpu_after, n, true);
    sample.redis_cpu(usec_before, usec_after, n);
    Ok(sample)
}

// ---------------------------------------------------------------------------------------------
// Peer locks

/// 3d: `rslock` lock + unlock of one resource per task (single server, so quorum 1).
pub(crate) struct RslockCycle {
    pub(crate) manager: rslock::LockManager,
    pub(crate) prefix: String,
}

impl Workload for RslockCycle {
    type State = Vec<u8>;

    fn state(&self, task: usize) -> Self::State {
        format!("{}:{task}", self.prefix).into_bytes()
    }

    async fn op(&self, resource: &mut Self::State) -> Outcome {
        match self.manager.lock(resource.as_slice(), LEASE_TTL).await {
            Ok(lock) => {
                self.manager.unlock(&lock).await;
                Outcome::Applied
            }
            Err(rslock::LockError::Unavailable) => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

static COMPARE_DEL: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(COMPARE_DEL_LUA));

/// 3e: the minimal lock without a token: `SET key owner NX PX ttl`, then a Lua
/// compare-and-delete, on the same kind of connection the issuer uses.
pub(crate) struct HandRolledCycle {
    pub(crate) conn: ConnectionManager,
    pub(crate) prefix: String,
}

impl Workload for HandRolledCycle {
    type State = String;

    fn state(&self, task: usize) -> Self::State {
        format!("{}:{task}", self.prefix)
    }

    async fn op(&self, key: &mut Self::State) -> Outcome {
        let mut conn = self.conn.clone();
        let owner = format!("{:032x}", rand::random::<u128>());
        let ttl_ms = u64::try_from(LEASE_TTL.as_millis()).expect("ttl fits u64");
        let set: redis::RedisResult<Option<String>> = redis::cmd("SET")
            .arg(&*key)
            .arg(&owner)
            .arg("NX")
            .arg("PX")
            .arg(ttl_ms)
            .query_async(&mut conn)
            .await;
        match set {
            Ok(Some(_)) => {}
            Ok(None) => return Outcome::Rejected,
            Err(e) => return Outcome::Failed(e.to_string()),
        }
        let deleted: redis::RedisResult<i64> = COMPARE_DEL
            .key(&*key)
            .arg(&owner)
            .invoke_async(&mut conn)
            .await;
        match deleted {
            Ok(1) => Outcome::Applied,
            Ok(n) => Outcome::Failed(format!("compare-del returned {n}")),
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}
