//! Section `scale` (rows 12a–12i, opt-in: `-- scale`, or `PGFENCE_BENCH_SCALE_ROWS` set): what
//! pgfence costs as the data grows (issue 34 point 3). With N = `PGFENCE_BENCH_SCALE_ROWS`
//! (default 10,000,000):
//!
//! - 12a / 12b: the repository's update SQL (1c's form: raw sqlx, the timeline bound) on a
//!   freshly loaded guarded table of 10,000 rows and of N rows, loaded the same way
//!   (`INSERT .. SELECT generate_series`, primary key, `guard`, `VACUUM (ANALYZE)`); the
//!   target is 12b ≥ 0.90 × 12a.
//! - 12c / 12d: `SELECT pgfence.check(resource, token, 0)` on random resources, with 10,000
//!   marks in `pgfence.resource_fence` (12c, measured once before the table is filled, so in
//!   round 1 only) and with N / 10 more (12d).
//! - 12e / 12f: `pgfence audit --resource R --since 1h`: [`pgfence::audit::list`] with the
//!   CLI's default limit (50), on N audit rows (30 days of rows over 1,000 resources, so R has
//!   N / 1,000 rows, about N / 720,000 in the last hour). 12e: each call on a new connection,
//!   as the CLI runs it (a custom plan); 12f: 20 calls on one connection (from the sixth on,
//!   PostgreSQL may switch to a generic plan). Latencies in ms (p50 / max in the p50 / p99
//!   columns); the target is ≤ 100 ms. The plan (`EXPLAIN (ANALYZE, BUFFERS)`, parameters
//!   bound) goes to stderr.
//! - 12g / 12h: [`pgfence::admin::doctor`] with the default options (tables scanned) on N /
//!   10,000 guarded tables (at least 1) plus the N / 10 (+ 10,000) resource marks, without an
//!   issuer (12g, `pgfence doctor --no-redis`) and with the Redis issuer (12h: every mark's
//!   counter read from Redis, one request each; the marks have no counter there, so every one
//!   is reported).
//! - 12i: [`pgfence::audit::prune`] of the audit rows older than 15 days (about half), in the
//!   last round only (it deletes what 12e/12f read).
//!
//! The set-up (the loads, timed) runs once, before round 1; its times are printed.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use pgfence::admin::DoctorOptions;
use pgfence::audit::AuditFilter;
use pgfence::{RedisIssuer, Repository, TokenIssuer, table::TableName};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, SqlSafeStr};

use crate::PAYLOAD;
use crate::measure::{Keys, Metric, Outcome, Sample, TOKENS, Workload, lease_fence, measure};
use crate::sections::{Results, put};
use crate::servers::{Env, tuned_pool};
use crate::workloads::RawFencedSql;

/// Rows of the small table (12a): the other sections' default table size.
const SMALL_ROWS: i32 = 10_000;

/// The resource the audit query asks for.
const AUDIT_RESOURCE: &str = "scale:7";

/// A row of the small scale table.
#[derive(Clone, Debug)]
struct SmallRow {
    id: i32,
    payload: String,
}

pgfence::fenced_table!(SmallRow {
    table: "bench_scale_small",
    key: id: i32,
    columns: [payload],
});

/// A row of the big scale table.
#[derive(Clone, Debug)]
struct BigRow {
    id: i32,
    payload: String,
}

pgfence::fenced_table!(BigRow {
    table: "bench_scale_big",
    key: id: i32,
    columns: [payload],
});

/// What the set-up made: sizes, the write statements, and the figures measured only there.
pub(crate) struct Setup {
    big_rows: i32,
    resources: i32,
    tables: i64,
    audit_rows: i64,
    small_sql: String,
    big_sql: String,
    /// Figures measured during the set-up (12c), recorded in round 1.
    pub(crate) pre: Vec<(String, Sample)>,
}

/// Runs `sql` (no parameters) on `pool`, and says how long it took.
async fn timed(pool: &PgPool, what: &str, sql: &str) -> Result<Duration> {
    let start = Instant::now();
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .with_context(|| format!("{what}: {sql}"))?;
    let took = start.elapsed();
    eprintln!("  scale set-up: {what}: {:.1} s", took.as_secs_f64());
    Ok(took)
}

/// Creates and loads a guarded table of `rows` rows.
async fn load_table(env: &Env, table: &str, rows: i64) -> Result<()> {
    timed(
        &env.admin,
        &format!("{table}: {rows} rows"),
        &format!(
            "CREATE TABLE {table} (id integer NOT NULL, payload text NOT NULL)
                 WITH (autovacuum_enabled = off);
             INSERT INTO {table} SELECT g, '{PAYLOAD}' FROM generate_series(1, {rows}) g;
             ALTER TABLE {table} ADD PRIMARY KEY (id);"
        ),
    )
    .await?;
    pgfence::guard::guard(&env.admin, &TableName::parse(table)?).await?;
    timed(
        &env.admin,
        &format!("VACUUM (ANALYZE) {table}"),
        &format!("VACUUM (ANALYZE) {table}"),
    )
    .await?;
    Ok(())
}

/// Loads the tables of section `scale` and measures 12c.
pub(crate) async fn prepare(env: &Env) -> Result<Setup> {
    let cfg = &env.cfg;
    let n = cfg.scale_rows;
    let big_rows = i32::try_from(n)?;
    let resources = i32::try_from(n / 10)?;
    let tables = (n / 10_000).max(1);
    eprintln!(
        "scale set-up: {n} rows, {n} audit rows, {resources} resource marks, {tables} guarded \
         tables"
    );
    load_table(env, "bench_scale_small", SMALL_ROWS.into()).await?;
    load_table(env, "bench_scale_big", n).await?;
    let sql_of = |pool: &PgPool| -> Result<(String, String)> {
        Ok((
            Repository::<SmallRow>::new(pool.clone())?
                .update_sql()
                .to_owned(),
            Repository::<BigRow>::new(pool.clone())?
                .update_sql()
                .to_owned(),
        ))
    };
    let (small_sql, big_sql) = sql_of(&env.admin)?;

    // Marks for a token every later token is above: checks with fresh tokens apply.
    let base = TOKENS.load(std::sync::atomic::Ordering::SeqCst).max(1);
    TOKENS.fetch_max(base, std::sync::atomic::Ordering::SeqCst);
    let mark = lease_fence(base);
    timed(
        &env.admin,
        &format!("{SMALL_ROWS} resource marks"),
        &format!(
            "INSERT INTO pgfence.resource_fence (resource, fence)
                 SELECT 'scale-s:' || g, {mark} FROM generate_series(1, {SMALL_ROWS}) g;
             ANALYZE pgfence.resource_fence;"
        ),
    )
    .await?;
    let mut pre = Vec::new();
    let pool = tuned_pool(env, cfg.pool).await?;
    let work = CheckMark {
        pool: pool.clone(),
        prefix: "scale-s:",
        tasks: cfg.tasks,
        marks: SMALL_ROWS,
    };
    let sample = measure(cfg, cfg.tasks, Metric::Applied, work).await?;
    eprintln!(
        "  [set-up] scale.check_small {:>10.0}/s",
        sample.ops_per_sec.unwrap_or(0.0)
    );
    pre.push(("scale.check_small".to_owned(), sample));
    pool.close().await;
    timed(
        &env.admin,
        &format!("{resources} more resource marks"),
        &format!(
            "INSERT INTO pgfence.resource_fence (resource, fence)
                 SELECT 'scale-r:' || g, {mark} FROM generate_series(1, {resources}) g"
        ),
    )
    .await?;
    // (VACUUM cannot share a multi-statement string: that runs as one transaction.)
    timed(
        &env.admin,
        "VACUUM (ANALYZE) pgfence.resource_fence",
        "VACUUM (ANALYZE) pgfence.resource_fence",
    )
    .await?;

    // 30 days of audit rows over 1,000 resources, ids in time order.
    let span = 30 * 86_400;
    timed(
        &env.admin,
        &format!("{n} audit rows"),
        &format!(
            "INSERT INTO pgfence.audit (at, resource, table_name, row_key, presented, current,
                                        holder, operation)
                 SELECT now() - (({n} - g) * {span}::float8 / {n}) * interval '1 second',
                        'scale:' || (g % 1000), '\"public\".\"orders\"', (g % 100000)::text,
                        g, g + 1, 'scale-holder', 'update'
                   FROM generate_series(1, {n}) g"
        ),
    )
    .await?;
    timed(
        &env.admin,
        "VACUUM (ANALYZE) pgfence.audit",
        "VACUUM (ANALYZE) pgfence.audit",
    )
    .await?;

    let start = Instant::now();
    for i in 0..tables {
        let table = format!("bench_scale_t{i}");
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {table} (id integer PRIMARY KEY, payload text NOT NULL);
             INSERT INTO {table} VALUES (1, '{PAYLOAD}');"
        )))
        .execute(&env.admin)
        .await?;
        pgfence::guard::guard(&env.admin, &TableName::parse(&table)?).await?;
    }
    eprintln!(
        "  scale set-up: {tables} guarded tables: {:.1} s",
        start.elapsed().as_secs_f64()
    );
    Ok(Setup {
        big_rows,
        resources,
        tables,
        audit_rows: n,
        small_sql,
        big_sql,
        pre,
    })
}

/// 12c / 12d: `pgfence.check` of random resources `<prefix>1 ..= <prefix><marks>` (each task
/// its own), each with a fresh token.
struct CheckMark {
    pool: PgPool,
    prefix: &'static str,
    tasks: usize,
    marks: i32,
}

impl Workload for CheckMark {
    type State = (Keys, String);

    fn state(&self, task: usize) -> Self::State {
        (Keys::new(task, self.tasks, self.marks), String::new())
    }

    async fn op(&self, (keys, name): &mut Self::State) -> Outcome {
        use std::fmt::Write;
        name.clear();
        let _ = write!(name, "{}{}", self.prefix, keys.next());
        let done = sqlx::query("SELECT pgfence.check($1, $2, 0)")
            .bind(&*name)
            .bind(crate::measure::next_token().get())
            .execute(&self.pool)
            .await;
        match done {
            Ok(_) => Outcome::Applied,
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("PF001") => {
                Outcome::Rejected
            }
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// The audit query's filter: the CLI's `--resource R --since 1h` and default limit.
fn audit_filter() -> AuditFilter {
    AuditFilter {
        since: Some(time::OffsetDateTime::now_utc() - time::Duration::hours(1)),
        resource: Some(AUDIT_RESOURCE.to_owned()),
        limit: 50,
        after_id: None,
    }
}

/// A latency figure from one-off timings (ms): median as p50, the slowest as p99, and the
/// rate of back-to-back calls.
fn latency_sample(mut ms: Vec<f64>, note: String) -> Sample {
    ms.sort_by(f64::total_cmp);
    let total: f64 = ms.iter().sum();
    let n = ms.len() as u64;
    Sample {
        ops_per_sec: (total > 0.0).then(|| n as f64 * 1000.0 / total),
        seconds: total / 1000.0,
        applied: n,
        total_ops: n,
        p50_ms: pgfence_bench::median(ms.clone()),
        p99_ms: ms.last().copied(),
        note: Some(note),
        ..Sample::default()
    }
}

/// The plan of the audit query with its parameters bound (`EXPLAIN (ANALYZE, BUFFERS)` through
/// the extended protocol, so the planner sees the values, as for the CLI's one call).
async fn audit_plan(env: &Env) -> Result<Vec<String>> {
    let f = audit_filter();
    let sql = "EXPLAIN (ANALYZE, BUFFERS)
        SELECT id, at, resource, table_name, row_key, presented, current, holder, operation,
               other_counter, application_name, reason, db_user
          FROM pgfence.audit
         WHERE ($1::pg_catalog.timestamptz IS NULL OR at OPERATOR(pg_catalog.>=) $1)
           AND ($2::pg_catalog.text IS NULL OR resource OPERATOR(pg_catalog.=) $2
                OR (pg_catalog.right($2, 1) OPERATOR(pg_catalog.=) '*'
                    AND pg_catalog.starts_with(resource, pg_catalog.left($2, -1))))
           AND ($4::pg_catalog.int8 IS NULL OR id OPERATOR(pg_catalog.>) $4)
         ORDER BY CASE WHEN $4::pg_catalog.int8 IS NULL THEN id END DESC, id ASC
         LIMIT $3";
    let mut conn = PgConnection::connect_with(&env.db).await?;
    let plan: Vec<String> = sqlx::query_scalar(sql)
        .bind(f.since)
        .bind(f.resource)
        .bind(f.limit)
        .bind(f.after_id)
        .fetch_all(&mut conn)
        .await?;
    conn.close().await?;
    Ok(plan)
}

/// Section `scale`, one round (`last`: also 12i).
pub(crate) async fn scale(
    env: &Env,
    setup: &Setup,
    round: usize,
    last: bool,
    out: &mut Results,
) -> Result<()> {
    let cfg = &env.cfg;
    let pool = tuned_pool(env, cfg.pool).await?;

    // 12a / 12b, alternating which goes first.
    let even = round.is_multiple_of(2);
    for big in [even, !even] {
        let (table, sql, rows, key) = if big {
            (
                "bench_scale_big",
                &setup.big_sql,
                setup.big_rows,
                "scale.write_big",
            )
        } else {
            (
                "bench_scale_small",
                &setup.small_sql,
                SMALL_ROWS,
                "scale.write_small",
            )
        };
        sqlx::raw_sql(AssertSqlSafe(format!("VACUUM (ANALYZE) {table}")))
            .execute(&env.admin)
            .await?;
        let _ = sqlx::raw_sql("CHECKPOINT").execute(&env.admin).await;
        let work = RawFencedSql {
            pool: pool.clone(),
            sql: AssertSqlSafe(sql.clone()).into_sql_str(),
            tasks: cfg.tasks,
            rows,
            timeline: Some(env.timeline),
        };
        let sample = measure(cfg, cfg.tasks, Metric::Applied, work).await?;
        put(out, round, key, sample);
    }

    // 12d.
    let work = CheckMark {
        pool: pool.clone(),
        prefix: "scale-r:",
        tasks: cfg.tasks,
        marks: setup.resources,
    };
    let sample = measure(cfg, cfg.tasks, Metric::Applied, work).await?;
    put(out, round, "scale.check_big", sample);
    pool.close().await;

    // 12e: each call on a new connection, as the CLI runs it.
    let mut ms = Vec::new();
    let mut found = 0;
    for _ in 0..10 {
        let mut conn = PgConnection::connect_with(&env.db).await?;
        let start = Instant::now();
        found = pgfence::audit::list(&mut conn, &audit_filter())
            .await?
            .len();
        ms.push(start.elapsed().as_secs_f64() * 1000.0);
        conn.close().await?;
    }
    let plan = audit_plan(env).await?;
    if round == 1 {
        eprintln!("  audit query plan ({} audit rows):", setup.audit_rows);
        for line in &plan {
            eprintln!("    {line}");
        }
    }
    let scan = plan
        .iter()
        .find(|l| l.contains("Scan"))
        .map_or("no scan node", |l| l.trim().trim_start_matches("->").trim());
    let scan = scan.split("  (").next().unwrap_or(scan).to_owned();
    let note = format!(
        "ms; {found} rows of {} audit rows; {scan}",
        setup.audit_rows
    );
    put(out, round, "scale.audit_query", latency_sample(ms, note));

    // 12f: 20 calls on one connection (generic plan from the sixth on, if PostgreSQL likes it).
    let mut conn = PgConnection::connect_with(&env.db).await?;
    let mut ms = Vec::new();
    for _ in 0..20 {
        let start = Instant::now();
        pgfence::audit::list(&mut conn, &audit_filter()).await?;
        ms.push(start.elapsed().as_secs_f64() * 1000.0);
    }
    conn.close().await?;
    let late = ms[5..].iter().copied().fold(0.0, f64::max);
    let note = format!("ms; slowest of calls 6-20: {late:.1} ms");
    put(
        out,
        round,
        "scale.audit_query_one_conn",
        latency_sample(ms, note),
    );

    // 12g / 12h: doctor, as `pgfence doctor --no-redis` and with the Redis issuer.
    let issuer = RedisIssuer::connect(&env.redis_url).await?;
    for (key, with_issuer) in [("scale.doctor", false), ("scale.doctor_redis", true)] {
        let pool = tuned_pool(env, 1).await?;
        let start = Instant::now();
        let issuer: Option<&dyn TokenIssuer> = with_issuer.then_some(&issuer as &dyn TokenIssuer);
        let findings = pgfence::admin::doctor(&pool, issuer, &DoctorOptions::default()).await?;
        let took = start.elapsed().as_secs_f64() * 1000.0;
        pool.close().await;
        let note = format!(
            "ms; {} guarded tables, {} resource marks; {} findings",
            setup.tables,
            i64::from(setup.resources) + i64::from(SMALL_ROWS),
            findings.len()
        );
        put(out, round, key, latency_sample(vec![took], note));
    }

    // 12i: prune, once.
    if last {
        let older = time::OffsetDateTime::now_utc() - time::Duration::days(15);
        let start = Instant::now();
        let deleted = pgfence::audit::prune(&env.admin, older).await?;
        let took = start.elapsed().as_secs_f64() * 1000.0;
        let mut sample = latency_sample(
            vec![took],
            format!(
                "ms; deleted {deleted} of {} audit rows; ops/s = rows deleted per second",
                setup.audit_rows
            ),
        );
        sample.ops_per_sec = Some(deleted as f64 * 1000.0 / took.max(0.001));
        put(out, round, "scale.prune", sample);
    }
    Ok(())
}
