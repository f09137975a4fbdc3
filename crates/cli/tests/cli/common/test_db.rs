//! `pgfence` against a [`TestDb`] and the shared Redis, awaited, and its stdout.

use crate::support;

use std::process::{Command, Output, Stdio};

use support::{TestDb, redis_url};

use super::BIN;

pub(crate) async fn pgfence(db: &TestDb, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("DATABASE_URL", db.url())
        .env("REDIS_URL", redis_url().await)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("run pgfence")
}

pub(crate) fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).unwrap()
}
