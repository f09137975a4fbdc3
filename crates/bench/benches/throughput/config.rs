//! Benchmark settings, from the environment (`PGFENCE_BENCH_*`) and the command line (section
//! names).

use std::path::PathBuf;
use std::str::FromStr;

use anyhow::{Context, Result, anyhow, bail};

/// Benchmark settings.
#[derive(Clone, Debug, serde::Serialize)]
pub(crate) struct Config {
    /// Measured seconds per figure.
    pub(crate) secs: u64,
    /// Unmeasured seconds before each figure.
    pub(crate) warmup: u64,
    /// Concurrent tasks (pgbench / redis-benchmark clients).
    pub(crate) tasks: usize,
    /// sqlx pool size.
    pub(crate) pool: u32,
    /// Rows per table.
    pub(crate) rows: i32,
    /// Rounds; the report gives medians over rounds.
    pub(crate) rounds: usize,
    /// Concurrencies of the `scaling` section.
    pub(crate) scaling: Vec<usize>,
    /// Tokio worker threads (also pgbench `-j`).
    pub(crate) workers: usize,
    /// At most this many seconds each figure waits for a quiet machine (0: start at once).
    pub(crate) quiet_wait: u64,
    /// Where the JSON document goes.
    pub(crate) json: PathBuf,
    /// Sections to run; empty: all but the opt-in ones ([`OPT_IN`]).
    pub(crate) sections: Vec<String>,
    /// Section `scale`: rows of the big table and of the audit table; a tenth of it resource
    /// marks, a ten-thousandth of it guarded tables (`PGFENCE_BENCH_SCALE_ROWS`, default
    /// 10,000,000). Setting it runs the section without naming it.
    pub(crate) scale_rows: i64,
    /// Whether `PGFENCE_BENCH_SCALE_ROWS` was set.
    scale_asked: bool,
    /// Whether `PGFENCE_BENCH_IDLE_RESOURCES` was set (section `idle`'s N): it runs the
    /// section without naming it, as CI's smoke run does.
    idle_asked: bool,
}

/// Every section, in the order they run.
pub(crate) const SECTIONS: &[&str] = &[
    "write", "pgbench", "batch", "acquire", "job", "storm", "scaling", "etcd", "zk", "pg", "parts",
    "coalesce", "scale", "idle",
];

/// Sections that run only when named (or, for `scale`, when `PGFENCE_BENCH_SCALE_ROWS` is
/// set): they are slow (`idle` measures state, not speed).
pub(crate) const OPT_IN: &[&str] = &["scale", "idle"];

/// The environment variable `name`, parsed, or `default` when unset or blank.
fn env_or<T: FromStr>(name: &str, default: T) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().map_err(|e| anyhow!("{name}={v:?}: {e}")),
        _ => Ok(default),
    }
}

/// The build's target directory: `CARGO_TARGET_DIR`, else the one this executable was built
/// into (`<target>/<profile>/deps/throughput-…`), else `target`. Cargo runs a bench in its
/// package's directory (`crates/bench`), so a relative `target` would land there.
fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.parent()?.to_path_buf()))
        .filter(|dir| dir.join("CACHEDIR.TAG").is_file())
        .unwrap_or_else(|| PathBuf::from("target"))
}

impl Config {
    /// Reads the settings; `args` are the bench's arguments (section names, flags).
    pub(crate) fn from_env(args: &[String]) -> Result<Self> {
        let cpus = std::thread::available_parallelism().map_or(2, usize::from);
        let tasks: usize = env_or("PGFENCE_BENCH_TASKS", 16)?;
        let scaling = env_or("PGFENCE_BENCH_SCALING", "1,4,16,64".to_owned())?
            .split(',')
            .map(|s| s.trim().parse::<usize>().context("PGFENCE_BENCH_SCALING"))
            .collect::<Result<Vec<_>>>()?;
        let json = match std::env::var_os("PGFENCE_BENCH_JSON") {
            Some(p) => PathBuf::from(p),
            None => target_dir().join("bench-throughput.json"),
        };
        let sections: Vec<String> = args
            .iter()
            .filter(|a| !a.starts_with('-'))
            .cloned()
            .collect();
        if let Some(bad) = sections.iter().find(|s| !SECTIONS.contains(&s.as_str())) {
            bail!("unknown section {bad:?}; sections are {SECTIONS:?}");
        }
        let cfg = Self {
            secs: env_or("PGFENCE_BENCH_SECS", 3)?,
            warmup: env_or("PGFENCE_BENCH_WARMUP", 1)?,
            tasks,
            pool: env_or("PGFENCE_BENCH_POOL", u32::try_from(tasks)?)?,
            rows: env_or("PGFENCE_BENCH_ROWS", 10_000)?,
            rounds: env_or("PGFENCE_BENCH_ROUNDS", 3)?,
            scaling,
            workers: env_or("PGFENCE_BENCH_WORKERS", cpus)?,
            quiet_wait: env_or("PGFENCE_BENCH_QUIET_WAIT", 30)?,
            json,
            sections,
            scale_rows: env_or("PGFENCE_BENCH_SCALE_ROWS", 10_000_000)?,
            idle_asked: std::env::var("PGFENCE_BENCH_IDLE_RESOURCES")
                .is_ok_and(|v| !v.trim().is_empty()),
            scale_asked: std::env::var("PGFENCE_BENCH_SCALE_ROWS")
                .is_ok_and(|v| !v.trim().is_empty()),
        };
        let max_tasks = cfg
            .scaling
            .iter()
            .copied()
            .chain([cfg.tasks])
            .max()
            .unwrap_or(1);
        if cfg.secs == 0 || cfg.warmup == 0 || cfg.tasks == 0 || cfg.pool == 0 || cfg.rounds == 0 {
            bail!("PGFENCE_BENCH_SECS, _WARMUP, _TASKS, _POOL and _ROUNDS must be at least 1");
        }
        if cfg.scale_rows < 10_000 || cfg.scale_rows > i64::from(i32::MAX) {
            bail!("PGFENCE_BENCH_SCALE_ROWS must be between 10000 and 2^31 - 1");
        }
        if cfg.scaling.contains(&0) || usize::try_from(cfg.rows)? < max_tasks {
            bail!("every concurrency must be between 1 and PGFENCE_BENCH_ROWS");
        }
        Ok(cfg)
    }

    /// Whether `section` is to run.
    pub(crate) fn runs(&self, section: &str) -> bool {
        if self.sections.iter().any(|s| s == section) {
            return true;
        }
        if OPT_IN.contains(&section) {
            return (section == "scale" && self.scale_asked)
                || (section == "idle" && self.idle_asked);
        }
        self.sections.is_empty()
    }
}
