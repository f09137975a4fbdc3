//! Helpers the command modules share: the binary ([`BIN`]), [`text`], and [`Cli`] (the
//! binary against a [`TestDb`] and the shared Redis). Helpers that run the binary another way
//! are in [`exact_env`], [`urls`] and [`test_db`].

use crate::support;

use std::process::{Command, Output, Stdio};

use support::{TestDb, redis_url};

pub(crate) mod exact_env;
pub(crate) mod test_db;
pub(crate) mod urls;

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_pgfence");

pub(crate) fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub(crate) struct Cli {
    db_url: String,
    redis: String,
}

impl Cli {
    pub(crate) async fn new(db: &TestDb) -> Self {
        let db_url = db.url();
        Self {
            db_url,
            redis: redis_url().await,
        }
    }

    pub(crate) fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.args(args)
            .env("DATABASE_URL", &self.db_url)
            .env("REDIS_URL", &self.redis)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null());
        c
    }

    pub(crate) fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().expect("run pgfence")
    }

    pub(crate) fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "pgfence {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Runs a command that must fail with one clear line on stderr.
    pub(crate) fn fails(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(!out.status.success(), "pgfence {args:?} should fail");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.starts_with("pgfence: ") || err.starts_with("error: "),
            "{err}"
        );
        if err.starts_with("pgfence: ") {
            assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        }
        err
    }
}

pub(crate) async fn snapshot(db: &TestDb) -> (Vec<String>, i64) {
    let objects: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname || ':' || a.attname FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'public' AND a.attnum > 0 AND NOT a.attisdropped
         UNION ALL SELECT 'trigger:' || tgname FROM pg_trigger WHERE NOT tgisinternal ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let audit = support::audit_count(&db.pool).await;
    (objects, audit)
}
